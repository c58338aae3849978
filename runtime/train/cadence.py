"""What a finished step owes: the loop asks once per step, and `Due` holds every answer.

The evaluator, the checkpoint service, the stop agreement and the profile window each keep
their own cadence (`training.eval_every`, `checkpoint.every`, a signal, `[profile]`); `Cadence`
gathers their answers for a step in one place. Every host gets the same answers at the same
step, so the points the loop passes after them (saves, evals, a stop) line up across hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.host.coordination import StopAgreement
from runtime.observe.profile import ProfileWindow
from runtime.run.checkpoint import CheckpointService
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


class Cadence:
    """The due decisions of each step up to `end_step`."""

    def __init__(
        self,
        evaluator: Evaluator,
        ckpt: CheckpointService,
        stop: StopAgreement,
        profile: ProfileWindow,
        end_step: int,
    ) -> None:
        self.evaluator, self.ckpt, self.stop, self.profile = evaluator, ckpt, stop, profile
        self.end_step = end_step

    def after(self, step: int) -> Due:
        """The answers for `step`, once it has run; every host asks at every step (the stop
        agreement is a sync point of its own)."""
        profile = self.profile
        return Due(
            step=step,
            stop=self.stop.should_stop(step),
            save=self.ckpt.due(step),
            eval=self.evaluator.due(step),
            traced=profile.active(step),
            edge=step == self.end_step or profile.starts_after(step) or profile.ends_at(step),
        )
