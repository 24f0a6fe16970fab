"""Keep third-party noise that is not the user's business off the terminal.

Contract: ``quiet_third_party()`` (called when ``specter`` is imported) makes torchao skip its
optional C++ extensions (Specter uses only its pure-Python quantisation math, and loading the
``.so`` files against another torch build prints failures that look like a broken install),
silences the torchao logger below ERROR and PyTorch's ``_pytree`` deprecation warnings raised from
inside transformers/torchao, and drops accelerate's "parameters are on the meta device because
they were offloaded" line (the ``hf-offload`` baseline offloads on purpose).
``loading_quietly()`` hides transformers' weight-loading progress bars around a model load.
``one_line_warnings()`` (the CLIs call it) prints a warning Specter raises (a category of its own,
or one raised from its code) as ``warning: MESSAGE``, as the CLIs print their own, instead of
Python's two lines naming an internal source line. Setting ``SPECTER_VERBOSE=1`` (the CLIs' ``--verbose``) turns all of
it off, so the output is what the libraries print themselves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator

VERBOSE_ENV = "SPECTER_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_third_party() -> None:
    if verbose():
        return
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's enum registrations
    warnings.filterwarnings("ignore", message=r".*_pytree.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*_pytree.*", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r".*_pytree.*", category=UserWarning)
    logging.getLogger("accelerate.big_modeling").addFilter(_drop_offload_notice)


def _drop_offload_notice(record: logging.LogRecord) -> bool:
    return "on the meta device because they were offloaded" not in record.getMessage()


@contextlib.contextmanager
def loading_quietly() -> Iterator[None]:
    """transformers' progress bars off for the duration (unless verbose), restored afterwards."""
    if verbose():
        yield
        return
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


_SPECTER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def one_line_warnings() -> None:
    installed = getattr(warnings.formatwarning, "plain", None)
    if verbose() and installed is not None:  # an earlier CLI call in this process installed it
        warnings.formatwarning = installed
    if verbose() or installed is not None:
        return
    plain = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None) -> str:
        ours = category.__module__.split(".")[0] == "specter" or os.path.abspath(filename).startswith(_SPECTER_DIR)
        return f"warning: {message}\n" if ours else plain(message, category, filename, lineno, line)

    formatwarning.plain = plain  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


def unquiet() -> None:
    """Undo ``quiet_third_party`` as far as it can be undone (the torchao switch is read once,
    at its import): for ``--verbose``."""
    os.environ[VERBOSE_ENV] = "1"
    logging.getLogger("torchao").setLevel(logging.NOTSET)
    logging.getLogger("torch.utils._pytree").setLevel(logging.NOTSET)
    logging.getLogger("accelerate.big_modeling").removeFilter(_drop_offload_notice)
    warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[1] is not None
                                                               and "_pytree" in f[1].pattern)]
