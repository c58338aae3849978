"""What the kubelet does to a container's env values, command and arguments before the process
sees them: `$(NAME)` becomes NAME's value (left as written when NAME is unknown), `$$` becomes `$`
(the EnvVar and Container API reference; kubernetes' third_party/forked/golang/expansion)."""

from __future__ import annotations

from collections.abc import Mapping


def expand(text: str, env: Mapping[str, str]) -> str:
    """`text` after the kubelet's variable expansion against `env`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):  # a `$` that ends the text stays
            out.append(text[i])
            i += 1
            continue
        nxt = text[i + 1]
        close = text.find(")", i + 2) if nxt == "(" else -1
        if nxt == "$":
            out.append("$")  # the escape
        elif close >= 0:
            name = text[i + 2 : close]
            out.append(env.get(name, f"$({name})"))
            i = close + 1
            continue
        else:
            out.append("$" + nxt)  # `$x`, or `$(` that is never closed: kept
        i += 2
    return "".join(out)


def container_env(container: dict, given: Mapping[str, str]) -> dict[str, str]:
    """The literal (`value`) env of `container` as its process sees it: each value expanded
    against `given` (what the pod already has) and the variables listed before it."""
    env = dict(given)
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
    return env
