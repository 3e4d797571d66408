"""``mmlu``: MMLU-style evaluation traffic -- a per-subject few-shot prefix plus a question, skewed popularity.

57 subjects (MMLU's), popularity Zipf(1.0) over subjects; each subject has a 5-shot prefix (lognormal, median 700
tokens: a header naming the subject and five worked examples) and a pool of 246 questions (MMLU's 14,042 test
questions over 57 subjects); a question is ~90 tokens (lognormal) and is drawn uniformly from its subject's pool,
so the same question can come back (its whole prompt is then reusable). The answer is 2 tokens (a letter and
end-of-sequence). Poisson arrivals. No client routing key: routers derive it from the leading blocks, which the
few-shot prefix makes per-subject.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from p2pnode.config import DEFAULT_ARRIVAL_CV
from p2pnode.engine.simulated.request import SimRequest
from p2pnode.sim.blocks import BlockSpace
from p2pnode.sim.workloads.arrivals import arrival_times
from p2pnode.sim.workloads.base import Limit, PrefixTable, Stream, cumulative, hashed_lognormal, pick, zipf_weights

__all__ = ["Mmlu"]

NAME = "mmlu"
N_SUBJECTS = 57
SUBJECT_ZIPF = 1.0
QUESTIONS_PER_SUBJECT = 246
FEWSHOT_MEDIAN, FEWSHOT_SIGMA = 700, 0.35
QUESTION_MEDIAN, QUESTION_SIGMA = 90, 0.6
OUTPUT_TOKENS = 2


class Mmlu:
    #: Preferred simulation block size (``--block-size`` overrides it): ~800-token prompts whose reusable parts (a
    #: 700-token prefix, a 90-token question) are short.
    block_size = 64
    name = NAME
    description = "57 subjects (Zipf 1.0), 5-shot prefix per subject + one of 246 questions, 2-token answers"

    def __init__(self, arrival: str = "poisson", cv: float = DEFAULT_ARRIVAL_CV) -> None:
        self.arrival = arrival
        self.cv = cv
        self._cum = cumulative(zipf_weights(N_SUBJECTS, SUBJECT_ZIPF))

    def requests(self, qps: float | None, seed: int, space: BlockSpace, limit: Limit) -> Iterator[SimRequest]:
        if qps is None:
            raise ValueError(f"{NAME} needs a request rate")
        rng = random.Random(seed)
        prefixes = PrefixTable(
            space, lambda s: hashed_lognormal(seed, s, FEWSHOT_MEDIAN, FEWSHOT_SIGMA, 200, 3000), memo=N_SUBJECTS
        )
        for rid, t in enumerate(arrival_times(random.Random(seed ^ 0xA5A5), qps, self.arrival, self.cv)):
            if limit.reached(t, rid):
                return
            s = pick(rng.random(), self._cum)
            q = s * QUESTIONS_PER_SUBJECT + int(rng.random() * QUESTIONS_PER_SUBJECT)
            question = hashed_lognormal(seed ^ 0x51, q, QUESTION_MEDIAN, QUESTION_SIGMA, 16, 800)
            # The question's stream entity is the question itself: a repeated question repeats its blocks.
            yield Stream(space, q, prefixes.get(s)).request(rid, t, "", question, OUTPUT_TOKENS, "mmlu")
