"""Unit tests for build.py (standard library only).

Run with:  python3 -m unittest discover -s eval/corpora/perplexity-1m

Every sample below is written for these tests; no corpus text is used.  The tests never
download anything.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import hashlib
import io
import json
import struct
import sys
import tarfile
import tempfile
import unittest
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build  # noqa: E402


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------

def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_tar_gz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def make_ar(members: dict[str, bytes]) -> bytes:
    out = [b"!<arch>\n"]
    for name, data in members.items():
        hdr = (f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}").encode() + b"`\n"
        out.append(hdr + data + (b"\n" if len(data) % 2 else b""))
    return b"".join(out)


# R XDR serialization, written the way R writes it (version 2)
def r_int(v: int) -> bytes:
    return struct.pack(">i", v)


def r_charsxp(s: str | None) -> bytes:
    if s is None:
        return r_int(9) + r_int(-1)
    raw = s.encode("utf-8")
    return r_int(9 | (8 << 12)) + r_int(len(raw)) + raw  # UTF8 flag in the levels


def r_strsxp(items) -> bytes:
    return r_int(16) + r_int(len(items)) + b"".join(r_charsxp(x) for x in items)


def r_names_attr(names) -> bytes:
    # pairlist (LISTSXP with tag) holding one attribute, 'names'
    sym = r_int(1) + r_charsxp("names")
    return r_int(2 | (1 << 10)) + sym + r_strsxp(names) + r_int(254)


def r_serialize(body: bytes) -> bytes:
    return b"X\n" + r_int(2) + r_int(0x040200) + r_int(0x020300) + body


def r_lazyload_pair(objects: dict[str, bytes]) -> tuple[bytes, bytes]:
    """(rdx, rdb) with each object stored as 4-byte length + zlib, index gzipped."""
    rdb, entries = b"", []
    for name, ser in objects.items():
        blob = struct.pack(">I", len(ser)) + zlib.compress(ser)
        entries.append((name, len(rdb), len(blob)))
        rdb += blob
    intvecs = b"".join(r_int(13) + r_int(2) + r_int(off) + r_int(ln) for _, off, ln in entries)
    variables = (r_int(19 | (1 << 9)) + r_int(len(entries)) + intvecs
                 + r_names_attr([n for n, _, _ in entries]))
    empty_list = r_int(19) + r_int(0)
    compressed = r_int(10) + r_int(1) + r_int(1)
    index = (r_int(19 | (1 << 9)) + r_int(3) + variables + empty_list + compressed
             + r_names_attr(["variables", "references", "compressed"]))
    return gzip.compress(r_serialize(index)), rdb


# --------------------------------------------------------------------------------------
# normalizers
# --------------------------------------------------------------------------------------

class HtmlTests(unittest.TestCase):
    def test_entities_and_whitespace(self):
        src = "<html><body><p>Fish &amp; chips,\n   &lt;tag&gt;\t&#x4e2d;&#25991; &quot;q&quot;</p></body></html>"
        self.assertEqual(build.html_to_text(src), 'Fish & chips, <tag> 中文 "q"')

    def test_blocks_become_paragraphs(self):
        src = "<div><h2>Title</h2><p>One <b>bold</b> word.</p><ul><li>first</li><li>second</li></ul></div>"
        self.assertEqual(build.html_to_text(src), "Title\n\nOne bold word.\n\nfirst\n\nsecond")

    def test_navigation_toc_scripts_dropped(self):
        src = ("<html><head><title>T</title><style>p{}</style></head><body>"
               "<div class='navheader'><a href='x'>Prev</a> Next</div>"
               "<ul class='docnav'><li>Home</li></ul>"
               "<div class='toc'><dl><dt>1. Chapter</dt></dl></div>"
               "<script>var x = 1;</script><nav>menu</nav>"
               "<p>Body text.<a class='indexterm' id='i1'></a></p>"
               "<div class='navfooter'>footer</div></body></html>")
        self.assertEqual(build.html_to_text(src), "Body text.")

    def test_pre_verbatim(self):
        src = "<p>Run:</p><pre class='screen'>\n$ ls  -l\n\tindented &amp; <b>bold</b>\n\nlast</pre><p>after</p>"
        self.assertEqual(build.html_to_text(src),
                         "Run:\n\n$ ls  -l\n\tindented & bold\n\nlast\n\nafter")

    def test_table_rows_and_br(self):
        src = ("<table><tr><th>pkg</th><th>size</th></tr><tr><td>mc</td><td><p>1482</p></td></tr>"
               "</table><p>line one<br/>line two</p>")
        self.assertEqual(build.html_to_text(src), "pkg | size\nmc | 1482\n\nline one\nline two")

    def test_cjk_line_break_is_removed(self):
        self.assertEqual(build.html_to_text("<p>中文\n  文本 and\nEnglish</p>"), "中文文本 and English")

    def test_normalize_html_joins_documents(self):
        out = build.normalize_html(["<p>a</p>", "<p>b&nbsp;c</p>"])
        self.assertEqual(out, "a\n\nb c\n")


INFO_SAMPLE = (
    "This is sample.info, produced by makeinfo.\n\nINFO-DIR-SECTION X\nSTART-INFO-DIR-ENTRY\n"
    "* Sample: (sample).\nEND-INFO-DIR-ENTRY\n\n"
    "\x1f\nFile: sample.info,  Node: Top,  Next: Intro,  Up: (dir)\n\n"
    "Sample\n******\n\nA tiny manual.\n\n* Menu:\n\n* Intro::   The start.\n\n"
    "\x1f\nFile: sample.info,  Node: Intro,  Prev: Top,  Up: Top\n\n"
    "1 Intro\n*******\n\nFirst paragraph   \nwraps here.\n\n   Second one.\n\n"
    "\x1f\nFile: sample.info,  Node: Index,  Prev: Intro,  Up: Top\n\n"
    "Index\n*****\n\n\x00\x08[index\x00\x08]\n* Menu:\n\n* intro:   Intro.   (line 6)\n\n"
    "\x1f\nTag Table:\nNode: Top\x7f200\nNode: Intro\x7f300\n\x1f\nEnd Tag Table\n\n"
    "\x1f\nLocal Variables:\ncoding: utf-8\nEnd:\n"
)


class InfoTests(unittest.TestCase):
    def test_info_nodes(self):
        self.assertEqual(build.normalize_info(INFO_SAMPLE),
                         "Sample\n******\n\nA tiny manual.\n\n1 Intro\n*******\n\n"
                         "First paragraph\nwraps here.\n\n   Second one.\n")

    def test_info_has_no_control_characters(self):
        out = build.normalize_info(INFO_SAMPLE)
        for ch in "\x1f\x00\x08\x7f":
            self.assertNotIn(ch, out)
        self.assertNotIn("File:", out)
        self.assertNotIn("Menu", out)


MAN_SAMPLE = r""".\" a comment line
.de XX
.ds junk \\$1
..
.if \n(zZ=1 .ig zZ
.TH DEMO 1 "2024" "demo 1.0"
.SH NAME
demo \- show \(lqthings\(rq
.SH "OPTIONS"
Intro \fBbold\fP and \fIitalic\fR text
continues here.
.PP
.TP
.B \-a
Do \-a thing;
see
.BR other (1).
.TP 8
\fB\-\-long\fP=\fIN\fP
Long option.
.IP \(bu
bullet item
.PP
.if n plain branch
.if t troff branch
.nf
keep   this
  as is
.fi
a very \
long line
"""


class ManTests(unittest.TestCase):
    def test_render(self):
        self.assertEqual(build.normalize_man(MAN_SAMPLE),
                         "NAME\n\ndemo - show \u201cthings\u201d\n\nOPTIONS\n\n"
                         "Intro bold and italic text continues here.\n\n"
                         "-a\n    Do -a thing; see other(1).\n\n"
                         "--long=N\n    Long option.\n\n"
                         "\u2022 bullet item\n\n"
                         "plain branch\nkeep   this\n  as is\na very long line\n")

    def test_escapes(self):
        self.assertEqual(build.roff_escapes(r"\fB\e\-x\fP \(co \s-1SMALL\s0 \&.dot \"comment"),
                         "\\-x \u00a9 SMALL .dot ")

    def test_split_args(self):
        self.assertEqual(build.split_args(r'one "two words" "say ""hi""" \fBx\fP'),
                         ["one", "two words", 'say "hi"', r"\fBx\fP"])


class RDataTests(unittest.TestCase):
    def test_unserialize_character_vector(self):
        blob = r_serialize(r_strsxp(["It was", "", None, "caf\u00e9"]))
        v = build.r_unserialize(blob)
        self.assertEqual(v.sexptype, 16)
        self.assertEqual(list(v), ["It was", "", None, "caf\u00e9"])

    def test_unserialize_version3_header(self):
        body = r_strsxp(["x"])
        blob = b"X\n" + r_int(3) + r_int(0x040200) + r_int(0x030500) + r_int(5) + b"UTF-8" + body
        self.assertEqual(list(build.r_unserialize(blob)), ["x"])

    def test_named_list(self):
        body = (r_int(19 | (1 << 9)) + r_int(2) + r_strsxp(["a"]) + r_int(13) + r_int(1) + r_int(7)
                + r_names_attr(["text", "num"]))
        v = build.r_unserialize(r_serialize(body))
        self.assertEqual(v.names(), ["text", "num"])
        self.assertEqual(list(v[1]), [7])

    def test_lazyload_and_normalize(self):
        book = r_strsxp(["TITLE", "", "", "", "Chapter 1", "", "First line  ", "second line"])
        other = r_strsxp(["nope"])
        rdx, rdb = r_lazyload_pair({"other": r_serialize(other), "book": r_serialize(book)})
        text = build.normalize_rdata({"x/Rdata.rdx": rdx, "x/Rdata.rdb": rdb}, "book")
        self.assertEqual(text, "TITLE\n\nChapter 1\n\nFirst line\nsecond line\n")
        with self.assertRaisesRegex(build.BuildError, "no object 'missing'"):
            build.r_lazyload(rdx, rdb, "missing")

    def test_rejects_non_xdr(self):
        with self.assertRaises(build.BuildError):
            build.r_unserialize(b"A\n" + r_int(2))


class TextAndCodeTests(unittest.TestCase):
    def test_finish_prose(self):
        self.assertEqual(build.finish_prose("\r\n\r\nA  \r\nB\r\n\r\n\r\n\r\nC\n\n"), "A\nB\n\nC\n")

    def test_finish_code_keeps_bytes(self):
        src = "int x;  \n\n\n\tint y; // trailing  "
        self.assertEqual(build.finish_code(src), src + "\n")
        self.assertEqual(build.finish_code("a\r\nb\r\n"), "a\nb\n")

    def test_start_at(self):
        self.assertEqual(build.start_at("junk\nBook I\ntext\n", "Book I"), "Book I\ntext\n")
        with self.assertRaises(build.BuildError):
            build.start_at("junk\n", "Book I")


class ArchiveTests(unittest.TestCase):
    def test_ar_and_deb_members(self):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tf:
            for name, data in {"./usr/share/a.txt": b"alpha\n", "./usr/share/b.txt": b"beta\n"}.items():
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
        deb = make_ar({"debian-binary": b"2.0\n", "control.tar.xz": b"x", "data.tar.xz": buf.getvalue()})
        self.assertEqual(build.read_ar(deb)["debian-binary"], b"2.0\n")
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "pkg_1_all.deb"
            p.write_bytes(deb)
            got = build.deb_members(p, {"usr/share/b.txt"})
        self.assertEqual(got, {"usr/share/b.txt": b"beta\n"})

    def test_not_ar(self):
        with self.assertRaises(build.BuildError):
            build.read_ar(b"PK\x03\x04")


# --------------------------------------------------------------------------------------
# end to end on a synthetic package (no network)
# --------------------------------------------------------------------------------------

DOC_A = "First paragraph of a made-up document.\n\nSecond paragraph.\n\nThird paragraph.\n"
CODE_B = "// made-up kernel\nint f(int x) {\n  return x + 1;\n}\n"


# (domain id, stream id prefix), as in the real manifest
DOMAINS = [("english_reference", "en-ref"), ("english_long_form", "en-long"),
           ("chinese_reference", "zh-ref"), ("cuda_cpp_code", "code")]


def synthetic_manifest(pkg_bytes: bytes) -> dict:
    """A valid 16-stream manifest whose streams all come from one fake crate."""
    files = {f"demo-1.0/doc{i}.txt": (DOC_A.replace("made-up", f"made-up #{i}")).encode()
             for i in range(16)}
    streams = []
    for i in range(16):
        dom, prefix = DOMAINS[i // 4]
        sid = f"{prefix}-{i % 4 + 1}"
        member = f"demo-1.0/doc{i}.txt"
        text = files[member].decode()
        cut = text.split("\n\nThird")[0] + "\n"
        data = cut.encode()
        streams.append({
            "id": sid, "domain": dom, "path": f"streams/{sid}.txt", "title": f"demo {i}",
            "licence": "CC0-1.0", "bytes": len(data),
            "sha256": sha(data), "tokens": {"qwen3": None, "smollm2": None},
            "recipe": {"packages": [{"key": "Z", "name": "demo", "version": "1.0", "client": "cargo",
                                     "sha256": sha(pkg_bytes), "file": "demo-1.0.crate",
                                     "members": [member]}],
                       "normalize": "text", "cut": {"bytes": len(data)}}})
    ids = [s["id"] for s in streams]
    return {"corpus_id": "ninfer-ppl-1m-v1", "schema_version": 1, "description": "test",
            "domains": [{"id": d, "title": d} for d, _ in DOMAINS], "streams": streams,
            "modes": {"quick": ids[0::4], "full": ids}}


def synthetic_package() -> bytes:
    return make_tar_gz({f"demo-1.0/doc{i}.txt": DOC_A.replace("made-up", f"made-up #{i}").encode()
                        for i in range(16)} | {"demo-1.0/kernel.cu": CODE_B.encode()})


class EndToEndTests(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)
        self.pkgs = self.dir / "pkgs"
        self.pkgs.mkdir()
        self.pkg = synthetic_package()
        (self.pkgs / "demo-1.0.crate").write_bytes(self.pkg)
        self.manifest = synthetic_manifest(self.pkg)
        self.write_manifest(self.manifest)
        self.out = self.dir / "out"
        self.cache = self.dir / "cache"

    def tearDown(self):
        self.tmp.cleanup()

    def write_manifest(self, m):
        self.mpath = self.dir / "manifest.json"
        self.mpath.write_text(json.dumps(m))

    def run_main(self, *extra):
        err, out = io.StringIO(), io.StringIO()
        args = ["--manifest", str(self.mpath), "--out", str(self.out), "--cache", str(self.cache),
                *extra]
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = build.main(args)
        return rc, out.getvalue(), err.getvalue()

    def test_build_from_package_dir_then_idempotent(self):
        rc, out, err = self.run_main("--packages", str(self.pkgs), "--offline")
        self.assertEqual((rc, err), (0, ""))
        self.assertEqual((self.out / "en-ref-1.txt").read_text(),
                         "First paragraph of a made-up #0 document.\n\nSecond paragraph.\n")
        self.assertIn("licence: CC0-1.0", out)
        self.assertIn("ninfer-ppl-1m-v1: 16 streams in", out)
        self.assertEqual(sorted(p.name for p in self.out.iterdir()),
                         sorted(f"{s['id']}.txt" for s in self.manifest["streams"]))
        quick_lines = [l.split()[0] for l in out.splitlines() if " quick " in l]
        self.assertEqual(quick_lines, ["en-ref-1", "en-long-1", "zh-ref-1", "code-1"])
        # second run: nothing to do, and no package needed at all
        (self.pkgs / "demo-1.0.crate").unlink()
        rc, out, err = self.run_main("--offline")
        self.assertEqual(rc, 0, err)
        self.assertIn("en-ref-1: up to date", out)

    def test_package_found_by_content_under_another_name(self):
        (self.pkgs / "demo-1.0.crate").rename(self.pkgs / "renamed.gz")
        rc, _, err = self.run_main("--packages", str(self.pkgs), "--offline", "--quick")
        self.assertEqual(rc, 0, err)
        self.assertEqual(sorted(p.name for p in self.out.iterdir()),
                         ["code-1.txt", "en-long-1.txt", "en-ref-1.txt", "zh-ref-1.txt"])

    def test_quick_follows_modes_quick_order(self):
        m = copy.deepcopy(self.manifest)
        m["modes"]["quick"] = ["code-2", "zh-ref-3", "en-ref-1", "en-long-4"]
        build.validate_manifest(m)
        self.write_manifest(m)
        rc, out, err = self.run_main("--packages", str(self.pkgs), "--offline", "--quick")
        self.assertEqual(rc, 0, err)
        built = [l.split(":")[0] for l in out.splitlines() if l.endswith(" bytes)")]
        self.assertEqual(built, m["modes"]["quick"])
        self.assertEqual(sorted(p.name for p in self.out.iterdir()),
                         sorted(f"{i}.txt" for i in m["modes"]["quick"]))
        got = build.build(m, self.out, self.cache, None, True, quick=True, log=lambda *a: None)
        self.assertEqual([s["id"] for s in got], m["modes"]["quick"])
        # --stream narrows the quick streams, still in modes.quick order
        got = build.build(m, self.out, self.cache, None, True, only=["en-ref-1", "code-2", "code-1"],
                          quick=True, log=lambda *a: None)
        self.assertEqual([s["id"] for s in got], ["code-2", "en-ref-1"])

    def test_package_sha_mismatch(self):
        (self.pkgs / "demo-1.0.crate").write_bytes(self.pkg + b"tampered")
        rc, out, err = self.run_main("--packages", str(self.pkgs), "--offline")
        self.assertEqual(rc, 1)
        self.assertEqual(err.count("\n"), 1)
        self.assertIn("package demo 1.0", err)
        self.assertIn("expected " + sha(self.pkg), err)
        self.assertIn("got " + sha(self.pkg + b"tampered"), err)
        self.assertFalse(self.out.exists() and any(self.out.iterdir()))

    def test_stream_sha_mismatch(self):
        m = copy.deepcopy(self.manifest)
        m["streams"][5]["sha256"] = "0" * 64
        self.write_manifest(m)
        rc, _, err = self.run_main("--packages", str(self.pkgs), "--offline")
        self.assertEqual(rc, 1)
        self.assertEqual(err.count("\n"), 1)
        sid = m["streams"][5]["id"]
        self.assertRegex(err, f"stream {sid}: sha256 mismatch: expected 0{{64}}")
        self.assertFalse((self.out / f"{sid}.txt").exists())
        leftovers = [p.name for p in self.out.iterdir() if p.name.startswith(".")]
        self.assertEqual(leftovers, [])

    def test_stale_output_is_rebuilt(self):
        self.assertEqual(self.run_main("--packages", str(self.pkgs), "--offline")[0], 0)
        (self.out / "code-2.txt").write_text("stale\n")
        rc, out, _ = self.run_main("--packages", str(self.pkgs), "--offline")
        self.assertEqual(rc, 0)
        self.assertIn("code-2: built", out)
        self.assertTrue(build.stream_ok(self.manifest["streams"][13], self.out))

    def test_missing_package_offline(self):
        rc, _, err = self.run_main("--offline")
        self.assertEqual(rc, 1)
        self.assertEqual(err.count("\n"), 1)
        self.assertIn("package demo 1.0 (demo-1.0.crate", err)
        self.assertIn("--offline", err)

    def test_missing_member(self):
        m = copy.deepcopy(self.manifest)
        m["streams"][0]["recipe"]["packages"][0]["members"] = ["demo-1.0/absent.txt"]
        self.write_manifest(m)
        rc, _, err = self.run_main("--packages", str(self.pkgs), "--offline")
        self.assertEqual(rc, 1)
        self.assertIn("lacks member demo-1.0/absent.txt", err)

    def test_code_stream_is_byte_for_byte(self):
        s = copy.deepcopy(self.manifest["streams"][12])
        s["recipe"]["normalize"] = "code"
        s["recipe"]["packages"][0]["members"] = ["demo-1.0/kernel.cu", "demo-1.0/kernel.cu"]
        members = build.package_members(s["recipe"]["packages"][0], self.pkgs / "demo-1.0.crate",
                                        ["demo-1.0/kernel.cu"])
        full = build.normalize_stream(s, members)
        self.assertEqual(full, CODE_B + "\n" + CODE_B)

    def test_cut_must_end_a_line(self):
        s = copy.deepcopy(self.manifest["streams"][0])
        s["recipe"]["cut"]["bytes"] = 5
        with self.assertRaisesRegex(build.BuildError, "does not fall at the end of a line"):
            build.cut_stream(s, DOC_A)
        s["recipe"]["cut"]["bytes"] = 10_000
        with self.assertRaisesRegex(build.BuildError, "fewer than the cut"):
            build.cut_stream(s, DOC_A)

    def test_unknown_stream(self):
        rc, _, err = self.run_main("--stream", "nope", "--offline")
        self.assertEqual(rc, 1)
        self.assertIn("unknown stream 'nope'", err)


# --------------------------------------------------------------------------------------
# the real manifest
# --------------------------------------------------------------------------------------

class ManifestTests(unittest.TestCase):
    def setUp(self):
        self.m = json.loads((HERE / "manifest.json").read_text(encoding="utf-8"))

    def test_real_manifest_is_valid(self):
        build.validate_manifest(self.m)
        self.assertEqual(self.m["corpus_id"], "ninfer-ppl-1m-v1")
        self.assertEqual(len(self.m["streams"]), 16)
        self.assertEqual([d["id"] for d in self.m["domains"]], [d for d, _ in DOMAINS])
        domain_of = {s["id"]: s["domain"] for s in self.m["streams"]}
        for d in self.m["domains"]:
            quick = [i for i in self.m["modes"]["quick"] if domain_of[i] == d["id"]]
            self.assertEqual(len(quick), 1, d["id"])
        ids = [s["id"] for s in self.m["streams"]]
        self.assertEqual(len(set(ids)), 16)
        self.assertEqual(self.m["modes"]["full"], ids)
        for s in self.m["streams"]:
            self.assertEqual(s["path"], f"streams/{s['id']}.txt")
            self.assertEqual(build.stream_file(s), f"{s['id']}.txt")
            prefix = dict(DOMAINS)[s["domain"]]
            self.assertRegex(s["id"], f"^{prefix}-[1-4]$")

    def test_written_in_find_cuts_form(self):
        # find_cuts.py --write rewrites the manifest; it must come out as committed
        import find_cuts
        text = (HERE / "manifest.json").read_text(encoding="utf-8")
        self.assertEqual(find_cuts.manifest_text(self.m), text)
        self.assertEqual(list(self.m), ["corpus_id", "schema_version", "description", "domains",
                                        "streams", "modes"])
        for s in self.m["streams"]:
            self.assertEqual(list(s), ["id", "domain", "path", "title", "licence", "bytes",
                                       "sha256", "tokens", "recipe"], s["id"])

    def test_plan(self):
        self.assertEqual(self.m["modes"]["quick"], ["en-ref-1", "en-long-1", "zh-ref-1", "code-1"])
        for s in self.m["streams"]:
            self.assertLessEqual(s["tokens"]["qwen3"], 60000, s["id"])
            self.assertEqual(s["recipe"]["cut"]["bytes"], s["bytes"])

    def test_packages_are_consistent(self):
        seen = {}
        for s in self.m["streams"]:
            for p in s["recipe"]["packages"]:
                rec = {k: v for k, v in p.items() if k != "members"}
                self.assertEqual(seen.setdefault(p["key"], rec), rec, p["key"])
        self.assertEqual(sorted(seen), list("ABCDEFGHIJKLMNO"))

    def mutated(self, fn):
        m = copy.deepcopy(self.m)
        fn(m)
        return m

    def assert_invalid(self, m, pattern):
        with self.assertRaisesRegex(build.BuildError, pattern):
            build.validate_manifest(m)

    def test_rejects_wrong_stream_count(self):
        self.assert_invalid(self.mutated(lambda m: m["streams"].pop()), "16 streams")

    def test_rejects_duplicate_ids(self):
        def dup(m):
            m["streams"][1]["id"] = m["streams"][0]["id"]
            m["streams"][1]["path"] = m["streams"][0]["path"]
        self.assert_invalid(self.mutated(dup), "duplicate stream id en-ref-1")

    def test_rejects_two_quick_in_a_domain(self):
        def two(m):
            m["modes"]["quick"][3] = "en-ref-2"
        self.assert_invalid(self.mutated(two),
                            "domain english_reference must have exactly one quick stream "
                            r"in modes.quick \(has 2\)")

    def test_rejects_no_quick_in_a_domain(self):
        self.assert_invalid(self.mutated(lambda m: m["modes"]["quick"].remove("code-1")),
                            r"domain cuda_cpp_code must have exactly one quick .*\(has 0\)")

    def test_rejects_old_shape_and_wrong_corpus_id(self):
        def old(m):
            m["name"] = m.pop("corpus_id")
        self.assert_invalid(self.mutated(old), "corpus_id must be ninfer-ppl-1m-v1")
        self.assert_invalid(self.mutated(lambda m: m.update(corpus_id="other")),
                            "corpus_id must be ninfer-ppl-1m-v1")

    def test_rejects_bad_path(self):
        msg = "stream en-ref-1: path must be streams/en-ref-1.txt"
        for bad in ("en-ref-1.txt", "streams/en-ref-2.txt", "./streams/en-ref-1.txt",
                    "streams/../en-ref-1.txt", "/streams/en-ref-1.txt", None):
            with self.subTest(path=bad):
                self.assert_invalid(self.mutated(lambda m: m["streams"][0].update(path=bad)), msg)

        def old(m):
            m["streams"][0]["file"] = m["streams"][0].pop("path").split("/")[1]
        self.assert_invalid(self.mutated(old), msg)

    def test_rejects_bad_modes(self):
        def drop(*keys):
            def fn(m):
                d = m
                for k in keys[:-1]:
                    d = d[k]
                del d[keys[-1]]
            return fn
        self.assert_invalid(self.mutated(drop("modes")), "manifest: modes missing")
        self.assert_invalid(self.mutated(lambda m: m.update(modes=["quick"])), "modes missing")
        self.assert_invalid(self.mutated(drop("modes", "quick")), "modes.quick missing or empty")
        self.assert_invalid(self.mutated(drop("modes", "full")), "modes.full missing or empty")
        self.assert_invalid(self.mutated(lambda m: m["modes"].update(quick=[])),
                            "modes.quick missing or empty")
        self.assert_invalid(self.mutated(lambda m: m["modes"].update(full="en-ref-1")),
                            "modes.full missing or empty")
        self.assert_invalid(self.mutated(lambda m: m["modes"]["full"].append("nope")),
                            "modes.full: unknown stream 'nope'")
        self.assert_invalid(self.mutated(lambda m: m["modes"]["quick"].__setitem__(0, "en-ref-9")),
                            "modes.quick: unknown stream 'en-ref-9'")
        self.assert_invalid(self.mutated(lambda m: m["modes"]["quick"].__setitem__(0, 1)),
                            "modes.quick: unknown stream 1")
        self.assert_invalid(self.mutated(lambda m: m["modes"]["quick"].append("code-1")),
                            "modes.quick: duplicate stream id code-1")
        self.assert_invalid(self.mutated(lambda m: m["modes"]["full"].append("zh-ref-2")),
                            "modes.full: duplicate stream id zh-ref-2")
        self.assert_invalid(self.mutated(lambda m: m["modes"]["full"].remove("zh-ref-2")),
                            r"modes.full must list all 16 streams \(lacks zh-ref-2\)")

    def test_refusal_is_one_line_from_main(self):
        m = self.mutated(lambda m: m["modes"].pop("quick"))
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "manifest.json"
            path.write_text(json.dumps(m), encoding="utf-8")
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = build.main(["--manifest", str(path), "--out", str(Path(d) / "out"),
                                 "--offline", "--quick"])
        self.assertEqual(rc, 1)
        self.assertEqual(err.getvalue(), "error: manifest: modes.quick missing or empty\n")

    def test_rejects_wrong_domains(self):
        self.assert_invalid(self.mutated(lambda m: m["domains"].pop()), "4 domains")
        self.assert_invalid(self.mutated(lambda m: m["streams"][0].update(domain="fr-ref")),
                            "unknown domain")
        # the old domain ids are no longer known
        self.assert_invalid(self.mutated(lambda m: m["streams"][0].update(domain="en-ref")),
                            "stream en-ref-1: unknown domain 'en-ref'")

    def test_rejects_bad_recipe(self):
        self.assert_invalid(
            self.mutated(lambda m: m["streams"][0]["recipe"].update(normalize="pdf")),
            "unknown normalize")
        self.assert_invalid(
            self.mutated(lambda m: m["streams"][0]["recipe"]["packages"][0].update(client="curl")),
            "unknown client")
        self.assert_invalid(
            self.mutated(lambda m: m["streams"][0]["recipe"]["cut"].update(bytes=7)),
            "cut.bytes differs")


if __name__ == "__main__":
    unittest.main()
