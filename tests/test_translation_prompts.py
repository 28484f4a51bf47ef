"""German translation prompts from a fortunes-de package: parsing, filtering, reproducibility, bad input."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from hf_bpd.training import translation_prompts as tp

FORTUNES = {
    "zitate": "\n%\n".join(
        [
            "Die Welt ist eine Pulverfabrik, in der das Rauchen verboten ist.\n\t\t-- Anonym",
            "Vorsicht ist die Einstellung, die das Leben sicher macht,\naber selten glücklich.",
            "Zu kurz.",  # under 5 words
            "a) Toaster\nb) Toaster\nc) Glühbirne",  # a list
            "Fritz: Wo warst du?\nHans: Im Garten.",  # dialogue
            'Er sagte "Hallo" und ging dann nach Hause zu seiner Frau.',  # quotation marks
            "Die Welt ist eine Pulverfabrik, in der das Rauchen verboten ist.",  # a duplicate
        ]
    ),
    "asciiart": "   /\\_/\\   ( o.o )   > ^ <   das ist eine Katze mit vielen Zeichen",  # a skipped file
    "unfug": "Ich kann mich an allem gewöhnen, nur nicht am Dativ!\n%\nEin Tag ohne Lachen ist ein verlorener Tag.",
}


def deb_bytes(files: dict[str, str], data_name: str = "data.tar.xz") -> bytes:
    """A minimal .deb: an ar archive with debian-binary, control.tar.xz and a data tar of the fortunes,
    where NAME.u8 links to NAME and NAME.dat is a binary index, as in the real package."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for name, text in files.items():
            raw = text.encode("utf-8")
            info = tarfile.TarInfo(f"./{tp.FORTUNES_DIR}{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
            link = tarfile.TarInfo(f"./{tp.FORTUNES_DIR}{name}.u8")
            link.type, link.linkname = tarfile.SYMTYPE, name
            tar.addfile(link)
            index = tarfile.TarInfo(f"./usr/share/games/fortunes-de/{name}.dat")
            index.size = 4
            tar.addfile(index, io.BytesIO(b"\x00\x01\x02\x03"))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", b"x" * 3), (data_name, data.getvalue())]
    out = io.BytesIO()
    out.write(b"!<arch>\n")
    for name, blob in members:
        out.write(f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(blob):<10}`\n".encode())
        out.write(blob + (b"\n" if len(blob) % 2 else b""))
    return out.getvalue()


def test_prose_drops_attribution_line_breaks_lists_dialogue_and_short_texts():
    texts = {tp.prose(f) for f in FORTUNES["zitate"].split("\n%\n")} - {None}
    assert texts == {
        "Die Welt ist eine Pulverfabrik, in der das Rauchen verboten ist.",
        "Vorsicht ist die Einstellung, die das Leben sicher macht, aber selten glücklich.",
    }


def test_deb_and_installed_folder_give_the_same_files(tmp_path):
    deb = tmp_path / "fortunes-de_0.35-1_all.deb"
    deb.write_bytes(deb_bytes(FORTUNES))
    folder = tmp_path / "de"
    folder.mkdir()
    for name, text in FORTUNES.items():
        (folder / name).write_text(text, encoding="utf-8")
        (folder / f"{name}.u8").symlink_to(name)
    assert tp.fortune_files_from_deb(deb) == FORTUNES == tp.fortune_files_from_dir(folder)


def test_prompts_are_reproducible_distinct_and_skip_non_prose_files(tmp_path):
    rows = tp.translation_prompts(FORTUNES, num=4, seed=0)
    assert rows == tp.translation_prompts(FORTUNES, num=4, seed=0)
    assert rows != tp.translation_prompts(FORTUNES, num=4, seed=1)
    assert [r["id"] for r in rows] == ["de-0", "de-1", "de-2", "de-3"]
    assert len({r["prompt"] for r in rows}) == 4 and not any("asciiart" in r["source"] for r in rows)
    assert all(any(r["prompt"].startswith(t.split("{")[0]) for t in tp.TEMPLATES) for r in rows)
    with pytest.raises(ValueError, match="only 4 German prose fortunes"):
        tp.translation_prompts(FORTUNES, num=5)
    deb = tmp_path / "f.deb"
    deb.write_bytes(deb_bytes(FORTUNES))
    out = tmp_path / "de.jsonl"
    assert tp.main(["--deb", str(deb), "--output", str(out), "--num", "4"]) == 0
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == rows


def test_bad_packages_are_refused_by_name(tmp_path):
    not_deb = tmp_path / "x.deb"
    not_deb.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="not a Debian package"):
        tp.fortune_files_from_deb(not_deb)
    other = tmp_path / "other.deb"
    other.write_bytes(deb_bytes({}, data_name="data.tar.xz"))
    with pytest.raises(ValueError, match="is it the fortunes-de package"):
        tp.fortune_files_from_deb(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no fortune files"):
        tp.fortune_files_from_dir(tmp_path / "empty")
