"""On/off environment variables (PAGEDSERVE_LAZY_TORCH_IMPORT=0, ...), parsed one way everywhere.

Accepted, case-insensitive and with surrounding blanks ignored: 1/true/yes/on and 0/false/no/off (vLLM's envs.py
reads its switches as "1"/"0" through int() and some as "true"/"false"; both sets are accepted here). Unset or empty
(compose passes `${NAME:-}` as "") means the switch's default. Anything else is a SwitchError naming the variable:
a typo ("flase", "disabled") must not silently leave a switch as it was. Imports nothing but the standard library,
so both services (and the scheduler's pure core) may use it.

Scripts read theirs with the same parse: `python -m client.switches NAME on|off` prints the switch's value, on or
off (the second argument is its default), or exits 2 with the SwitchError's line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


class SwitchError(ValueError):
    """An on/off environment variable holds something that is neither."""


def parse_switch(name: str, text: str | None, default: bool) -> bool:
    """The value of switch `name` given its text (None or blank: `default`)."""
    value = (text or "").strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SwitchError(f"{name}={text!r} is not a switch value: use one of {'/'.join(ON)} (on) "
                      f"or {'/'.join(OFF)} (off), or leave it unset ({'on' if default else 'off'})")


def env_switch(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """The switch `name` read from `environ` (the process's environment when None)."""
    source = os.environ if environ is None else environ
    return parse_switch(name, source.get(name), default)


def main(argv: Sequence[str]) -> int:
    """`NAME on|off`: print the switch NAME read from the environment (default: the second argument), on or off."""
    if len(argv) != 2 or argv[1] not in ("on", "off"):
        print("usage: python -m client.switches NAME on|off  (the second argument: its default)", file=sys.stderr)
        return 2
    try:
        print("on" if env_switch(argv[0], argv[1] == "on") else "off")
    except SwitchError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
