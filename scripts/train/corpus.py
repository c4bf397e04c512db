"""The training corpus: Python source files installed on the machine, chosen deterministically.

Selection (documented in scripts/train/README.md; change it only with a new CORPUS_VERSION):
  1. Candidates: every `*.py` file under the interpreter's standard library
     (`sysconfig.get_paths()["stdlib"]`) and under the site-packages folders of the packages in
     SITE_PACKAGES (`sysconfig.get_paths()["purelib"]`), skipping folders named test, tests,
     testing, _vendor, vendor, __pycache__ and site-packages inside the stdlib. Each file is
     named by a machine-independent key: "stdlib/<relative path>" or "site/<relative path>".
  2. Filters: 512 B to 256 KiB, valid UTF-8, no line longer than 400 characters (drops generated
     tables and minified data).
  3. Order: by sha256 of the key (a fixed pseudo-random order that does not depend on how the
     file system lists folders).
  4. Split: in that order, files go to the held-out split until it holds HELDOUT_BYTES, then to
     the training split until it holds TRAIN_BYTES; the rest is unused. No training step sees a
     held-out file.
The corpus digest (sha256 over the keys and contents of both splits, in order) is printed with
every run: equal digests mean equal corpora.
"""

import hashlib
import os
import sysconfig

CORPUS_VERSION = 1
SITE_PACKAGES = [
    "torch", "transformers", "numpy", "scipy", "sympy", "sklearn", "pandas", "networkx",
    "matplotlib", "jax", "flax", "optax", "accelerate", "huggingface_hub", "tokenizers",
    "safetensors", "requests", "urllib3", "aiohttp", "httpx", "click", "rich", "pygments",
    "jinja2", "markdown", "yaml", "werkzeug", "pytest", "_pytest", "hypothesis", "sentencepiece",
    "tqdm", "filelock", "fsspec", "packaging", "setuptools", "pip", "xarray", "statsmodels",
    "lightning", "pytorch_lightning", "torchvision", "torchaudio", "triton", "onnx", "optimistix",
    "equinox", "diffrax", "numpyro", "botorch", "gpytorch", "timm", "sentence_transformers",
    "peft", "seaborn", "skimage", "PIL", "dateutil", "sortedcontainers", "toolz", "typer",
]
SKIP_DIRS = {"test", "tests", "testing", "_vendor", "vendor", "__pycache__", "site-packages", "dist-packages"}
MIN_BYTES, MAX_BYTES, MAX_LINE = 512, 256 * 1024, 400
HELDOUT_BYTES = 1 << 20
TRAIN_BYTES = 64 << 20


def _walk(root, prefix):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield prefix + os.path.relpath(path, root).replace(os.sep, "/"), path


def candidates():
    """(key, path) of every candidate file, before filtering."""
    paths = sysconfig.get_paths()
    found = dict(_walk(paths["stdlib"], "stdlib/"))
    site = paths["purelib"]
    for pkg in SITE_PACKAGES:
        top = os.path.join(site, pkg)
        if os.path.isdir(top):
            found.update(_walk(top, f"site/{pkg}/"))
    return sorted(found.items())


def _read(path):
    try:
        size = os.path.getsize(path)
        if not MIN_BYTES <= size <= MAX_BYTES:
            return None
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if max(len(line) for line in text.splitlines()) > MAX_LINE:
        return None
    return text


class Corpus:
    """The two splits as lists of (key, text), and the digest of both."""

    def __init__(self, train, heldout, digest, candidates):
        self.train, self.heldout, self.digest, self.candidates = train, heldout, digest, candidates

    def describe(self):
        mb = lambda docs: sum(len(t.encode()) for _, t in docs) / 1e6
        return (f"corpus v{CORPUS_VERSION}: {len(self.candidates)} candidate files; train {len(self.train)} files "
                f"{mb(self.train):.1f} MB, held-out {len(self.heldout)} files {mb(self.heldout):.2f} MB; "
                f"digest {self.digest[:16]}")


def load(heldout_bytes=HELDOUT_BYTES, train_bytes=TRAIN_BYTES):
    cands = candidates()
    order = sorted(cands, key=lambda kp: hashlib.sha256(kp[0].encode()).hexdigest())
    digest = hashlib.sha256(f"v{CORPUS_VERSION}".encode())
    train, heldout, held, used = [], [], 0, 0
    for key, path in order:
        if used >= train_bytes:
            break
        text = _read(path)
        if text is None:
            continue
        n = len(text.encode())
        digest.update(key.encode() + b"\0" + text.encode() + b"\0")
        if held < heldout_bytes:
            heldout.append((key, text))
            held += n
        else:
            train.append((key, text))
            used += n
    return Corpus(train, heldout, digest.hexdigest(), cands)


if __name__ == "__main__":
    print(load().describe())
