"""The tour's rows: our own targets for MemoryMeter (no paper), judged from the tour's records.

Both expected values are computed by hand from the sizes the code allocates, not by the meter: the
allocation check asks for 2.5 MB + 10 MB, frees the first and asks for 1 MB (peak 12.5 MB); after a
training step without an optimizer the only tensors left are the parameters and their gradients, so
the gradient bytes equal the parameter bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from workbench.report import Claim, Ledger, Measured, at_most, judge

__all__ = ["CLAIMS", "ledger"]


def _allocation_error(records: Mapping[str, pd.DataFrame], params: Mapping) -> Measured | None:
    if "allocation" not in records:
        return None
    row = records["allocation"].iloc[0]
    return Measured(abs(row.peak_bytes - row.expected_peak_bytes), scale="12.5 MB of uint8 tensors")


def _gradient_error(records: Mapping[str, pd.DataFrame], params: Mapping) -> Measured | None:
    if "step" not in records:
        return None
    row = records["step"].iloc[0]
    return Measured(abs(row.grad_bytes - row.param_bytes),
                    scale=f"{row.model} ({row.stem} stem), batch {row.batch_size}, {row.image_size}x{row.image_size}")


CLAIMS = (
    Claim("MemoryMeter peak is exact for plain allocations (2.5 MB + 10 MB, free, 1 MB)", unit="bytes of error",
          paper="0 (ours)", measure=_allocation_error, rule=at_most(0), source="target",
          definition="|metered peak - 12,500,000 B|; the expected peak is computed by hand"),
    Claim("After a training step the live bytes equal the parameter bytes (the gradients)", unit="bytes of error",
          paper="0 (ours)", measure=_gradient_error, rule=at_most(0), source="target",
          definition="|gradient bytes - parameter bytes| after backward; parameter bytes counted from the model"),
)


def ledger(records: Mapping[str, pd.DataFrame], params: Mapping, *, device: str, device_class: str,
           verdicts: bool) -> Ledger:
    """The tour's ledger from its records ("allocation", "step")."""
    return judge(CLAIMS, records, params, device=device, device_class=device_class, verdicts=verdicts)
