"""What one generation measured: SpecStats. Prefill and decode are reported apart.

Conventions (as vLLM): acceptance_rate = accepted / drafted; mean_accepted_length (tau) = tokens emitted
per target verification forward, the bonus/correction token included; per_position_acceptance[j] =
P(draft token j+1 accepted | it was drafted and reached).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens whose KV was kept from the previous turn (chat)
    new_tokens: int = 0
    setup_s: float = 0.0        # before the prefill: the target's runner (its first generation: the lean
                                # loop's probe and weight packing, seconds on a real model; SpecModel.warm_up)
    prefill_s: float = 0.0      # target (and model drafter) forward over the prompt
    ttft_s: float = 0.0         # setup + prefill + choosing the first token: what the caller waits
    decode_s: float = 0.0       # everything after the first token (and the drafter's prefill)
    total_s: float = 0.0        # wall time from the start of the generation (setup included) to the last token
    target_forwards: int = 0    # verification forwards (prefill excluded)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)
    tested_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    tracker: dict | None = None  # the policy's AcceptanceTracker state, when it has one
    step: str = ""              # what ran the target's forwards: 'compiled' | 'lean' | 'hf' (hf/compiled.py)
    compile_s: float = 0.0      # of which spent compiling the step (a bucket's first use; inside the times)
    offload: str = ""           # the target's disk-offloaded weights: 'mapped' | 'copied' | '' (hf/mapped_offload.py)

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        return self.decode_s / max(1, self.new_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole generation (prefill, both models', included)."""
        total = self.total_s or (self.ttft_s + self.decode_s)
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        emitted = self.new_tokens - 1  # the first token comes from prefill
        return emitted / self.target_forwards if self.target_forwards else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance without the censoring bias: accepted / (accepted + first rejections).

        Positions after a step's first rejection were never tested, so they count neither way."""
        tested = sum(self.tested_by_position)
        return sum(self.accepted_by_position) / tested if tested else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_by_position, self.tested_by_position)]

    def record_step(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """drafted: tokens (tree nodes) proposed; accepted: path length; depth: the draft's deepest level
        (a chain's length; for a tree the positions that could be tested are its depths, not its nodes)."""
        self.draft_lengths.append(drafted)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.target_forwards += 1
        tested = min(drafted if depth is None else depth, accepted + 1)
        while len(self.tested_by_position) < tested:
            self.tested_by_position.append(0)
            self.accepted_by_position.append(0)
        for j in range(tested):
            self.tested_by_position[j] += 1
            self.accepted_by_position[j] += j < accepted

    @classmethod
    def combine(cls, rows: list["SpecStats"]) -> "SpecStats":
        """A batch's stats from its rows' (generated together, batch.py): tokens, drafts and acceptance by
        position summed; the times (prefill, TTFT, decode, total) the batch's wall clock, the longest row's;
        target_forwards the batch's forwards (the longest row's). tokens_per_s is then the batch's
        throughput and acceptance_rate / alpha pool every row's drafts."""
        out = cls()
        for r in rows:
            for name in ("prompt_tokens", "reused_prompt_tokens", "new_tokens", "drafted_tokens", "accepted_tokens",
                         "draft_s"):
                setattr(out, name, getattr(out, name) + getattr(r, name))
            for name in ("setup_s", "prefill_s", "ttft_s", "decode_s", "total_s", "target_forwards", "verify_s"):
                setattr(out, name, max(getattr(out, name), getattr(r, name)))
            for mine, theirs in ((out.tested_by_position, r.tested_by_position),
                                 (out.accepted_by_position, r.accepted_by_position)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for j, v in enumerate(theirs):
                    mine[j] += v
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("tpot_s", "tokens_per_s", "acceptance_rate", "alpha", "mean_accepted_length",
                     "per_position_acceptance"):
            d[name] = getattr(self, name)
        return d

    def _setup_note(self) -> str:
        """The setup inside TTFT, where it is worth naming (a model's first generation)."""
        return f", first-use setup {self.setup_s * 1e3:.0f} ms" if self.setup_s >= 0.05 else ""

    def summary(self) -> str:
        step = f" | step {self.step}" + (f" (compiling {self.compile_s:.1f} s)" if self.compile_s else "") if self.step else ""
        step += f", offloaded weights {self.offload}" if self.offload else ""
        return (f"{self.new_tokens} tokens, {self.tokens_per_s:.1f} tok/s{step} | acceptance {self.acceptance_rate:.2f}, "
                f"tau {self.mean_accepted_length:.2f} | TTFT {self.ttft_s * 1e3:.1f} ms (prefill "
                f"{self.prefill_s * 1e3:.1f} ms{self._setup_note()}), TPOT {self.tpot_s * 1e3:.2f} ms, decode {self.decode_s:.2f} s")
