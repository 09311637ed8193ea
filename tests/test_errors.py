"""The error hierarchy."""

from __future__ import annotations

import pytest

from opsd.errors import ConfigError, OpsError, PermanentError, TransientError


def test_hierarchy() -> None:
    assert issubclass(TransientError, OpsError)
    assert issubclass(ConfigError, PermanentError)
    assert issubclass(ConfigError, ValueError)
    assert TransientError("timeout", retry_after_s=2.5).retry_after_s == 2.5


def test_negative_retry_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="retry_after_s"):
        TransientError("x", retry_after_s=-1)
