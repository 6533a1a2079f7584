"""What rank 0 measures at load and every rank of its TP group then runs: per range of a batch's
token count, the implementation that runs (and the times it was chosen on). They cross the TP
control channel as records (engine/parallel/step.py engine_types), so they live below it.

- `MethodChoice`: a mixture's expert compute method (engine/layers/expert_compute.py select_method);
- `PrefillForms`: an MLA layer's prefill form, one of `FORMS` (engine/layers/mla.py).
"""
from __future__ import annotations

from dataclasses import dataclass

FORMS = ("expanded", "absorbed")  # an MLA prefill's forms (engine/layers/mla.py)


@dataclass(frozen=True)
class MethodChoice:
    """Per token-count range, the expert method that runs, and the times it was chosen on."""

    ranges: tuple[tuple[int | None, str], ...]  # (largest token count; None: any larger, method)
    ms: tuple[dict[str, float], ...] = ()  # per range, each method's time for one layer

    def method(self, num_tokens: int) -> str:
        return next(m for limit, m in self.ranges if limit is None or num_tokens <= limit)

    def describe(self) -> str:
        if not self.ms:
            return f"{self.ranges[0][1]} for every batch"
        return "; ".join(f"{m} for {'<=' + str(limit) if limit is not None else 'more'} tokens ("
                         + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()) + ")"
                         for (limit, m), ms in zip(self.ranges, self.ms))


@dataclass(frozen=True)
class PrefillForms:
    """Per range of a prefill's query count, the form it runs, and the times it was chosen on."""

    ranges: tuple[tuple[int | None, str], ...]
    ms: tuple[dict[str, float], ...] = ()

    @classmethod
    def fixed(cls, form: str) -> PrefillForms:
        assert form in FORMS, form
        return cls(((None, form),))

    def form(self, num_queries: int) -> str:
        return next(f for limit, f in self.ranges if limit is None or num_queries <= limit)

    def describe(self) -> str:
        if not self.ms:
            return f"{self.ranges[0][1]} for every prefill"
        return "; ".join(f"{f} for {'<=' + str(limit) if limit is not None else 'more'} tokens ("
                         + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()) + ")"
                         for (limit, f), ms in zip(self.ranges, self.ms))
