"""How a dataset's rows are counted: one definition for ``budgetq check`` and the producer's summary.

- ``valid``: a prompt that can be sent (the first row with its id);
- ``invalid``: a row never sent because it is bad, **repeated ids included** (a later row with an
  earlier row's id is written to out/<ds>.invalid.jsonl like any bad row, and counted in the
  ledger's ``invalid``, which ``status`` and the summary show);
- ``duplicates``: of the invalid rows, those whose id repeats an earlier row's;
- ``filtered``: left out by the dataset's filter (not an error).

So ``check``'s ``47 valid, 5 invalid (1 of them a duplicate id)`` and the summary's ``invalid 5``, ``of them
duplicate ids 1`` are the same rows counted the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from budgetq.producer.reading.reader import Filtered, Invalid, Prompt


@dataclass
class RowTally:
    valid: int = 0
    invalid: int = 0      # duplicates included
    duplicates: int = 0   # of ``invalid``: ids an earlier row had
    filtered: int = 0

    def add(self, item: Prompt | Invalid | Filtered) -> None:
        if isinstance(item, Prompt):
            self.valid += 1
        elif isinstance(item, Invalid):
            self.invalid += 1
            self.duplicates += item.duplicate
        else:
            self.filtered += 1

    def describe(self) -> str:
        """``47 valid, 5 invalid (1 of them a duplicate id), 0 filtered``: what check prints."""
        dup = f" ({self.duplicates:,} of them {'a duplicate id' if self.duplicates == 1 else 'duplicate ids'})" \
            if self.duplicates else ""
        return f"{self.valid:,} valid, {self.invalid:,} invalid{dup}, {self.filtered:,} filtered"
