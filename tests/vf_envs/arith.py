"""A single-turn verifiers environment for the tests (env=verifiers env.verifiers.id=vf_envs.arith): the embedded arith
task's rows, a rubric of two weighted rewards and a metric. Its `poison` argument names answers whose `brief` reward
raises (an episode verifiers marks failed)."""

import verifiers.v1 as vf

from rlcli.core.answers import extract_final_answer_or_none
from rlcli.data.arith import arith_examples


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(extract_final_answer_or_none(trace.last_reply or "") == self.data.answer)

    @vf.reward(weight=0.25)
    async def brief(self, trace: vf.Trace) -> float:
        if self.data.answer in self.config.poison:
            raise ValueError(f"poisoned answer {self.data.answer}")
        return float(len(trace.last_reply or "") <= 12)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class ArithTaskConfig(vf.TaskConfig):
    poison: list[str] = []


class ArithConfig(vf.TasksetConfig):
    num_rows: int = 64
    digits: int = 2
    task: ArithTaskConfig = ArithTaskConfig()


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        rows = arith_examples("train", self.config.num_rows, seed=5, min_digits=self.config.digits,
                              max_digits=self.config.digits)
        for i, row in enumerate(rows):
            yield ArithTask(ArithData(id=f"arith-{i}", prompt=row["prompt"], answer=row["answer"]), self.config.task)


__all__ = ["ArithTaskset"]
