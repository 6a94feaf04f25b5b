"""A multi-turn verifiers environment with a tool for the tests (env=verifiers env.verifiers.id=vf_envs.calc): the
calculator recipe's task as a verifiers taskset. Its tool is an MCP server (verifiers starts it as `python -m vf_envs.calc`),
`calc(expression)`, answering as rlcli.envs.calculator:agent's tool messages do, so that the policy sees exactly the
conversation of recipe=tools/calculator_agent; the rubric is that agent's reward and a bonus for a call."""

import verifiers.v1 as vf

from rlcli.core.answers import extract_final_answer_or_none
from rlcli.data.arith import arith_examples
from rlcli.envs.calculator import calc as rlcli_calc


class CalcTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is called `calc`, as the calculator warm start writes it

    @vf.tool
    def calc(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression with +, -, * and parentheses."""
        try:
            return rlcli_calc(expression)[:32]
        except ValueError as e:
            return f"error: {type(e).__name__}: {e}"[:32]


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        written = "".join(m.content or "" for m in trace.messages if m.role == "assistant" and isinstance(m.content, str))
        return float(extract_final_answer_or_none(written) == self.data.answer)

    @vf.reward(weight=0.1)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)


class CalcConfig(vf.TasksetConfig):
    num_rows: int = 64
    seed: int = 3
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcTools(config.tools)]

    def load(self):
        rows = arith_examples("train", self.config.num_rows, seed=self.config.seed, min_digits=2, max_digits=2)
        for i, row in enumerate(rows):
            yield CalcTask(CalcData(id=f"calc-{i}", prompt=row["prompt"], answer=row["answer"]), self.config.task)


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    CalcTools.run()
