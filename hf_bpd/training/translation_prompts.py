"""German-to-English translation prompts for self-distillation, from real German text (no benchmark text).

Why: translation is where the heads draft worst (docs/history.md: τ about 1.2 on Spec-Bench's German to
English rows, against 2 and more for chat). The heads never saw German input: the bundled training prompts
are English, and `hf_bpd.training.instructions` only has templated sentences. Heads learn what the base model
does on the prompts they see, so they need German sentences of real variety to learn how it translates.

Source: Debian's `fortunes-de` package (German quotations, sayings, anecdotes; GPL-2+). Its text is
not copied into this repository: the prompts are built on the user's machine from the package file, so
the recipe is reproducible from a pinned package version and its checksum:

    apt-get download fortunes-de        # fortunes-de_0.35-1_all.deb
    python -m hf_bpd.training.translation_prompts --deb fortunes-de_0.35-1_all.deb \
        --output runs/de_prompts.jsonl --num 1000
    hf-bpd distill --prompts runs/de_prompts.jsonl --output runs/distill_de ...

A fortune becomes a prompt when it is prose: one to three sentences of 5-40 words once the attribution
("-- Author") and line breaks are removed, mostly letters, no lists, dialogue or English parts. The
selection is sorted, de-duplicated and drawn with `--seed`, so it is determined by the package and the
arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import random
import re
import tarfile
from pathlib import Path

from hf_bpd.io.jsonl import write_jsonl

# the phrasing most translation requests use, and two others so that the heads do not learn one wording
TEMPLATES = (
    "Translate German to English: {text}",
    "Translate German to English: {text}",
    "Translate this German text into English: {text}",
    "What does this German sentence mean in English? {text}",
)
# files that are not German prose: pictures, German-English glossaries, multiple-choice quizzes, name lists
SKIP_FILES = {"asciiart", "translations", "quiz", "vornamen", "namen", "woerterbuch"}
FORTUNES_DIR = "usr/share/games/fortunes/de/"


def fortune_files_from_deb(deb: str | Path) -> dict[str, str]:
    """{name: utf-8 text} of the German fortune files inside a fortunes-de .deb (an `ar` archive holding
    `data.tar.*`), read with the standard library so that no Debian tool is needed."""
    blob = Path(deb).read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise ValueError(f"{deb} is not a Debian package (.deb): no ar archive header")
    pos, data = 8, None
    while pos + 60 <= len(blob):
        name = blob[pos : pos + 16].decode().strip().rstrip("/")
        size = int(blob[pos + 48 : pos + 58].decode().strip())
        if name.startswith("data.tar"):
            data = blob[pos + 60 : pos + 60 + size]
            break
        pos += 60 + size + (size % 2)  # members are 2-byte aligned
    if data is None:
        raise ValueError(f"{deb} has no data.tar member: not a complete Debian package")
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar.getmembers():
            path = member.name.removeprefix("./")
            # the UTF-8 text files; `NAME.u8` are links to them and `NAME.dat` strfile indexes
            if member.isfile() and path.startswith(FORTUNES_DIR) and not path.endswith(".dat"):
                files[Path(path).name] = tar.extractfile(member).read().decode("utf-8")
    if not files:
        raise ValueError(f"{deb} holds no fortune files under {FORTUNES_DIR}: is it the fortunes-de package?")
    return files


def fortune_files_from_dir(folder: str | Path) -> dict[str, str]:
    """The same from an installed package's folder (/usr/share/games/fortunes/de)."""
    paths = [p for p in sorted(Path(folder).iterdir()) if p.is_file() and not p.is_symlink() and p.suffix != ".dat"]
    files = {p.name: p.read_text(encoding="utf-8") for p in paths}
    if not files:
        raise ValueError(f"{folder} holds no fortune files")
    return files


def prose(fortune: str) -> str | None:
    """The fortune as one line of German prose, or None when it is not prose worth translating."""
    lines = [ln for ln in fortune.strip().splitlines() if not re.match(r"\s*--", ln)]  # drop "-- Author"
    if not lines or any(re.match(r"\s*([a-z]\)|\*|-|\d+\.|[A-ZÄÖÜ][\w ]{0,20}:)", ln) for ln in lines):
        return None  # lists, headings, dialogue ("Fritz: ..."): not one text to translate
    text = re.sub(r"\s+", " ", " ".join(lines)).strip()
    words = text.split()
    letters = sum(c.isalpha() or c.isspace() for c in text)
    sentences = len(re.findall(r"[.!?](\s|$)", text))
    if not 5 <= len(words) <= 40 or letters < 0.85 * len(text) or sentences > 3 or '"' in text:
        return None
    return text


def translation_prompts(files: dict[str, str], num: int, seed: int = 0) -> list[dict]:
    """`num` prompts (id, source, prompt) drawn with `seed` from the prose fortunes of `files`."""
    texts = sorted(
        {
            (name, t)
            for name, body in files.items()
            if name not in SKIP_FILES
            for f in body.split("\n%\n")
            if (t := prose(f))
        }
    )
    if num > len(texts):
        raise ValueError(f"only {len(texts)} German prose fortunes; asked for {num}")
    r = random.Random(seed)
    chosen = r.sample(texts, num)
    return [
        {"id": f"de-{i}", "source": f"fortunes-de/{name}", "prompt": r.choice(TEMPLATES).format(text=text)}
        for i, (name, text) in enumerate(chosen)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--deb", help="a fortunes-de .deb (apt-get download fortunes-de)")
    source.add_argument("--fortunes-dir", help="an installed fortunes-de folder (/usr/share/games/fortunes/de)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--num", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.deb:
        files = fortune_files_from_deb(args.deb)
        print(f"{args.deb}: sha256 {hashlib.sha256(Path(args.deb).read_bytes()).hexdigest()}")
    else:
        files = fortune_files_from_dir(args.fortunes_dir)
    rows = translation_prompts(files, args.num, args.seed)
    write_jsonl(args.output, rows)
    print(f"wrote {len(rows)} prompts to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
