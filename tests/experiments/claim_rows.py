"""Finding one claim's row in a claims module's ledger by the start of its text (imported by the claims tests;
not a test module)."""

from types import ModuleType


def claim_text(claims: ModuleType, prefix: str) -> str:
    """The one claim text of `claims.CLAIMS` that starts with `prefix`."""
    found = [c.text for c in claims.CLAIMS if c.text.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return found[0]


def claim_row(claims: ModuleType, prefix: str, records: dict, *, device_class: str, verdicts: bool = True) -> dict:
    """The ledger row of the claim starting with `prefix`, judged on hand-made `records`."""
    ledger = claims.ledger(records, {}, device="test device", device_class=device_class, verdicts=verdicts)
    text = claim_text(claims, prefix)
    return next(r for r in ledger.rows if r["claim"] == text)
