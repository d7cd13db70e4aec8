"""The package's errors: one base, so ``except reshard.ReshardError`` catches every refusal and failure.

    error          base                       raised when
    ReshardError   Exception                  (the base of the three below)
    LayoutError    ReshardError, ValueError   a layout, a pair of layouts or a rank's buffers are wrong:
                                              found before any byte moves, the same on every rank
    OptionsError   ReshardError, ValueError   a refit option is wrong (:class:`reshard.options.RefitOptions`)
    RefitError     ReshardError, RuntimeError a refit, connect or recovery failed on some rank; every
                                              rank raises it (:mod:`reshard.execution.control`)

>>> issubclass(OptionsError, ReshardError) and issubclass(OptionsError, ValueError)
True
"""

from __future__ import annotations


class ReshardError(Exception):
    """Base of every error the package raises on purpose."""


class OptionsError(ReshardError, ValueError):
    """A refit option is wrong; the message names the option (and the method, where it is the method's)."""


__all__ = ["OptionsError", "ReshardError"]
