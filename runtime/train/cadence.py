"""What a finished step owes: the loop asks once per step, and `Due` holds every answer.

The evaluator, the stop agreement and the profile window each keep their own cadence
(`training.eval_every`, a signal, `[profile]`); which steps are checkpoints is decided here
(`checkpoint_due`: `checkpoint.every` before the last step; `final_save`: the end's, unless a
signal stopped the run and `checkpoint.on_signal` is off), and the checkpoint service saves what
it is told. `Cadence` gathers the answers for a step in one place. Every host gets the same
answers at the same step, so the points the loop passes after them (saves, evals, a stop) line
up across hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.host.coordination import StopAgreement
from runtime.observe.profile import ProfileWindow
from runtime.train.evaluate import Evaluator


@dataclass(frozen=True)
class Due:
    """What the loop does after `step`."""

    step: int
    stop: bool  # every host agreed to stop here (a signal): the attempt ends after this step
    save: bool  # a periodic checkpoint (the final one is the loop's end)
    eval: bool  # a periodic eval
    traced: bool  # the step ran inside the profile window: no throughput figures
    edge: bool  # the last step, or the step before or at a profile window's edge

    @property
    def pause(self) -> bool:
        """A save or an eval: its time is not training throughput."""
        return self.save or self.eval

    @property
    def sync(self) -> bool:
        """The step's rows are fetched now: nothing non-finite is saved or evaluated, and a
        stop, the end or a profile window starts from rows on the host."""
        return self.pause or self.stop or self.edge


def checkpoint_due(step: int, *, every: int, last_step: int | None) -> bool:
    """Whether `step` is a periodic checkpoint: every `every`-th step (`checkpoint.every`; 0 is
    none) before `last_step` (`training.total_steps`), whose save is the end's (`final_save`)."""
    before_last = last_step is None or step < last_step
    return every > 0 and step % every == 0 and before_last


def final_save(status: str, *, on_signal: bool) -> bool:
    """Whether an attempt that ended `status` saves its last step: always, except after a signal
    (SIGTERM/SIGINT: "interrupted") with `checkpoint.on_signal` off."""
    return status != "interrupted" or on_signal


class Cadence:
    """The due decisions of each step up to `end_step`."""

    def __init__(
        self,
        evaluator: Evaluator,
        stop: StopAgreement,
        profile: ProfileWindow,
        end_step: int,
        *,
        save_every: int,
        last_step: int,
    ) -> None:
        """`save_every`, `last_step`: `checkpoint.every` and `training.total_steps` (a run
        stopped early by --max-steps keeps the periodic saves a whole run makes)."""
        self.evaluator, self.stop, self.profile = evaluator, stop, profile
        self.end_step = end_step
        self.save_every, self.last_step = save_every, last_step

    def after(self, step: int) -> Due:
        """The answers for `step`, once it has run; every host asks at every step (the stop
        agreement is a sync point of its own)."""
        profile = self.profile
        return Due(
            step=step,
            stop=self.stop.should_stop(step),
            save=checkpoint_due(step, every=self.save_every, last_step=self.last_step),
            eval=self.evaluator.due(step),
            traced=profile.active(step),
            edge=step == self.end_step or profile.starts_after(step) or profile.ends_at(step),
        )
