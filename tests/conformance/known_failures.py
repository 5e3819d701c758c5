"""Contract points today's code breaks: (test function, site) → why (issue 10).

Each entry makes that test a strict xfail on that site: when the fix lands, the test passes,
pytest reports XPASS(strict) as a failure, and the entry is deleted here.  An entry given as
(why, False) is a non-strict xfail: today's code fails it only when it loses a race."""

KNOWN_FAILURES: dict[tuple[str, str], "str | tuple[str, bool]"] = {}
