"""A job's requirements judged before anything is installed (worker/starting/requirements.py):
each kind classified, the policy and its refusals (where, why, how to allow), a
requirements.txt read without following links, paths kept inside the job's code, the
environment's key made of content, and the file the worker writes for pip. Fast: no pip,
no server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpq.errors import RequirementsRefused
from tests.helpers import make_wheel
from worker.starting.requirements import (
    MAX_FILE_BYTES,
    MAX_REQUIREMENTS,
    Policy,
    basis,
    logical_lines,
    pip_lines,
    read,
)

EVERYTHING = Policy.parse(["url", "option", "path-outside"])
WHEEL = "ddpqtestpkg-0.1-py3-none-any.whl"
HEX = "0123456789abcdef" * 4


def job(tmp_path: Path, requirements: str | None = None, name: str = "job") -> Path:
    """A job's code directory with a wheel in wheels/ and, if given, a requirements.txt."""
    d = tmp_path / name
    make_wheel(d / "wheels")
    if requirements is not None:
        (d / "requirements.txt").write_text(requirements)
    return d


def refusal(job_dir: Path | None, pip: list[str], policy: Policy = Policy()) -> str:
    with pytest.raises(RequirementsRefused) as e:
        read(job_dir, pip, policy)
    return str(e.value)


def test_the_policy_allows_names_and_paths_and_what_an_operator_adds() -> None:
    assert Policy().allowed == {"name", "path"}
    assert Policy.parse([]) == Policy()
    assert Policy.parse(["url", "option"]).allowed == {"name", "path", "url", "option"}
    assert Policy.parse(["URL, path-outside", "url"]).allowed == {
        "name",
        "path",
        "url",
        "path-outside",
    }
    for bad in ("urls", "", "index"):
        with pytest.raises(
            ValueError, match=r"^'.*' is not a kind of requirement: choose from url"
        ) as e:
            Policy.parse(["url", bad])
        assert "url" in str(e.value) and "option" in str(e.value) and "path-outside" in str(e.value)
    with pytest.raises(ValueError):
        Policy(frozenset({"url"}))  # names and paths are always allowed


def test_every_kind_is_classified(tmp_path: Path) -> None:
    d = job(
        tmp_path,
        "numpy>=1.26\n"
        f"./wheels/{WHEEL}\n"
        "pkg @ https://example.org/pkg-1.0-py3-none-any.whl\n"
        "git+https://example.org/repo.git@main#egg=repo\n"
        "https://example.org/x-1.0-py3-none-any.whl\n"
        "--index-url https://example.org/simple\n"
        "-e ./wheels\n"
        "pkg --config-settings=x=y\n"
        f"{tmp_path / 'outside.whl'}\n"
        f"wheels/{WHEEL}\n"
        f"{WHEEL}\n"
        ".\n",
    )
    (tmp_path / "outside.whl").write_bytes(b"x")
    os.rename(d / "wheels" / WHEEL, d / WHEEL)
    (d / "wheels" / WHEEL).symlink_to(d / WHEEL)
    reqs = read(d, ["requests", "./wheels"], EVERYTHING)
    assert [(r.where, r.kind) for r in reqs] == [
        ("requirements.txt line 1", "name"),
        ("requirements.txt line 2", "path"),
        ("requirements.txt line 3", "url"),
        ("requirements.txt line 4", "url"),
        ("requirements.txt line 5", "url"),
        ("requirements.txt line 6", "option"),
        ("requirements.txt line 7", "option"),
        ("requirements.txt line 8", "option"),
        ("requirements.txt line 9", "path-outside"),
        ("requirements.txt line 10", "path"),
        ("requirements.txt line 11", "path"),
        ("requirements.txt line 12", "path"),
        ("pip[0]", "name"),
        ("pip[1]", "path"),
    ]
    wheel = reqs[1]
    assert wheel.path == d.resolve() / "wheels" / WHEEL and wheel.digest is not None
    assert reqs[11].path == d.resolve() and reqs[11].digest is not None


def test_names_are_normalised_with_their_extras_specifiers_and_markers(tmp_path: Path) -> None:
    text = (
        'Foo_Bar.baz[Sec,all] >= 1.0 , <2 ; python_version<"3.12"\n'
        "plain\n"
        f"pinned==1.0 --hash sha256:{HEX.upper()} --hash=sha512:{'ab' * 64}\n"
        "spaced (>=2)\n"
    )
    reqs = read(job(tmp_path, text), [])
    assert [r.kind for r in reqs] == ["name"] * 4
    assert [r.line for r in reqs] == [
        'foo-bar-baz[all,sec]<2,>=1.0; python_version < "3.12"',
        "plain",
        f"pinned==1.0 --hash=sha256:{HEX} --hash=sha512:{'ab' * 64}",
        "spaced>=2",
    ]
    assert reqs[0].text == 'Foo_Bar.baz[Sec,all] >= 1.0 , <2 ; python_version<"3.12"'


def test_comments_blank_lines_and_continuations_are_read_as_pip_reads_them() -> None:
    text = (
        "# a comment\n"
        "\n"
        "numpy>=1  # why\n"
        "torch\\\n"
        "vision==1 \\\n"
        "  ; python_version < '3.12'\n"
        "   # indented comment\n"
        "url#frag\n"  # '#' not after a space: not a comment
        "last \\\n"
        "# a comment ends a continued line\n"
        "tail\\"
    )
    assert logical_lines(text) == [
        (3, "numpy>=1"),
        (4, "torchvision==1   ; python_version < '3.12'"),
        (8, "url#frag"),
        (9, "last"),
        (11, "tail"),
    ]
    assert logical_lines("\ufeffpkg\r\nother\r\n") == [(1, "\ufeffpkg"), (2, "other")]


def test_markers_and_extras_on_paths_are_kept(tmp_path: Path) -> None:
    d = job(tmp_path, f"./wheels/{WHEEL}[Fast,a] ; os_name=='posix'\n")
    (r,) = read(d, [])
    assert r.kind == "path"
    assert r.line == f'{d.resolve()}/wheels/{WHEEL}[a,fast]; os_name == "posix"'
    assert r.key.startswith(f"file {WHEEL} sha256:") and r.key.endswith(
        '[a,fast]; os_name == "posix"'
    )
    assert "is not one" in refusal(d, [f"./wheels/{WHEEL}; os_name=="])
    assert "extras that are not names" in refusal(d, [f"./wheels/{WHEEL}[a b]"])


POLICY_REFUSALS = [
    ("--index-url https://evil/simple", "is a pip option", "option"),
    ("-r ../other.txt", "is a pip option", "option"),
    ("pkg==1 --global-option=--x", "carries pip options ('--global-option=--x')", "option"),
    ("pkg @ http://elsewhere/pkg.whl", "is a direct URL", "url"),
    ("git+https://example.org/r.git", "is a URL", "url"),
    ("https://example.org/x-1-py3-none-any.whl", "is a URL", "url"),
    ("../outside.whl", "is outside the job's code", "path-outside"),
    ("/etc/passwd", "is outside the job's code", "path-outside"),
]


@pytest.mark.parametrize(("text", "why", "kind"), POLICY_REFUSALS)
def test_a_refusal_says_where_why_and_how_to_allow(
    tmp_path: Path, text: str, why: str, kind: str
) -> None:
    d = job(tmp_path, f"numpy\n# a comment\n{text}\n")
    (tmp_path / "outside.whl").write_bytes(b"x")
    message = refusal(d, [])
    assert message.startswith(f"requirements.txt line 3: '{text}' {why}; "), message
    assert "this worker installs only project names with version specifiers and files " in message
    assert message.endswith(f"(an operator can allow {_allow_words(kind)} --pip-allow {kind})")
    plain = job(tmp_path, name="plain")
    assert refusal(plain, [text]).startswith(f"pip[0]: '{text}' {why}; ")
    assert read(d, [], Policy.parse([kind]))[-1].kind == kind


def _allow_words(kind: str) -> str:
    return {
        "option": "pip options with",
        "url": "URLs with",
        "path-outside": "paths outside the job's code with",
    }[kind]


def test_a_refusal_quotes_at_most_200_characters_escaped(tmp_path: Path) -> None:
    text = "--index-url https://e/" + "x" * 500
    assert f"'{text[:200]}...' is a pip option" in refusal(None, [text])
    message = refusal(None, ["pkg\x1b[2J"])
    assert "'pkg\\x1b[2J' holds a control character" in message and "\x1b" not in message


@pytest.mark.parametrize(
    ("pip", "why"),
    [
        (["./wheels/not-there-0.1-py3-none-any.whl"], "does not exist in the job's code"),
        (["not-there.whl"], "does not exist in the job's code"),
        (["pkg=="], "is not a requirement: Expected"),
        (["pkg # a comment"], "holds a comment"),
        (["pkg\nother"], "is not one line"),
        (["pkg \\"], "is not one line"),
        (["https://example.org/${PIP_INDEX_URL}"], "names an environment variable"),
        ([f"pkg --hash=md5:{HEX}"], "has a hash pip would not check"),
        (["pkg --hash=sha256:abc"], "has a hash pip would not check"),
        (["pkg\x00"], "holds a control character"),
    ],
)
def test_what_no_policy_allows_is_refused_with_its_reason(
    tmp_path: Path, pip: list[str], why: str
) -> None:
    message = refusal(job(tmp_path), pip, EVERYTHING)
    assert message.startswith("pip[0]: ") and why in message, message


def test_a_missing_path_says_where_paths_start_and_what_leaves_files_out(tmp_path: Path) -> None:
    d = job(tmp_path, "./wheels/not-there-0.1-py3-none-any.whl\n")
    assert refusal(d, []) == (
        "requirements.txt line 1: './wheels/not-there-0.1-py3-none-any.whl' does not exist in "
        "the job's code (a path is relative to the top of the job's code; was it left out by a "
        ".ddpqignore or .gitignore?)"
    )
    assert "does not exist on this worker" in refusal(None, ["/nowhere/x.whl"], EVERYTHING)


def test_a_path_that_is_neither_a_file_nor_a_directory_is_refused(tmp_path: Path) -> None:
    d = job(tmp_path)
    os.mkfifo(d / "pipe.whl")
    assert "'./pipe.whl' is a named pipe, neither a file nor a directory" in refusal(
        d, ["./pipe.whl"], EVERYTHING
    )


def test_a_relative_path_needs_the_jobs_code(tmp_path: Path) -> None:
    assert "this job has no code" in refusal(None, [f"./wheels/{WHEEL}"], EVERYTHING)
    wheel = make_wheel(tmp_path / "shared")
    assert "is outside the job's code" in refusal(None, [str(wheel)])
    (r,) = read(None, [str(wheel)], EVERYTHING)
    assert r.kind == "path-outside" and r.line == str(wheel.resolve())


def test_a_symlinked_or_odd_requirements_txt_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "secret.txt"
    outside.write_text("numpy\n")
    d = job(tmp_path)
    (d / "requirements.txt").symlink_to(outside)
    assert refusal(d, []) == (
        "requirements.txt is a symbolic link; this worker reads only a regular file there "
        "(put the file itself in the job's code)"
    )
    (d / "requirements.txt").unlink()
    (d / "requirements.txt").symlink_to("wheels")  # a link inside is no better
    assert "is a symbolic link" in refusal(d, [])
    (d / "requirements.txt").unlink()
    (d / "requirements.txt").mkdir()
    assert refusal(d, []) == "requirements.txt is a directory, not a regular file"
    (d / "requirements.txt").rmdir()
    os.mkfifo(d / "requirements.txt")  # opened without blocking
    assert refusal(d, []) == "requirements.txt is a named pipe, not a regular file"
    (d / "requirements.txt").unlink()
    (d / "requirements.txt").write_bytes(b"numpy\n" + b"#" * MAX_FILE_BYTES)
    assert refusal(d, []) == "requirements.txt is larger than 1000 kB"
    (d / "requirements.txt").write_bytes(b"numpy\nna\xefve\n")
    assert refusal(d, []) == "requirements.txt is not UTF-8 text (line 2, byte 8)"
    (d / "requirements.txt").write_bytes("\ufeffnumpy\n".encode())  # a BOM is fine
    assert [r.line for r in read(d, [])] == ["numpy"]
    (d / "requirements.txt").unlink()
    assert read(d, []) == []


def test_too_many_requirements_are_refused(tmp_path: Path) -> None:
    d = job(tmp_path, "".join(f"pkg{i}\n" for i in range(MAX_REQUIREMENTS)))
    assert len(read(d, [])) == MAX_REQUIREMENTS
    assert "1001 requirements, more than 1000" in refusal(d, ["one-more"])


def test_a_path_through_a_link_out_is_path_outside(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    make_wheel(elsewhere)
    d = job(tmp_path)
    (d / "out").symlink_to(elsewhere)
    (d / "out.whl").symlink_to(elsewhere / WHEEL)
    for text in (f"./out/{WHEEL}", "./out.whl", f"wheels/../out/{WHEEL}"):
        message = refusal(d, [text])
        assert message.startswith(
            f"pip[0]: '{text}' leads outside the job's code through a link; "
        ), message
        assert message.endswith("--pip-allow path-outside)")
        (r,) = read(d, [text], EVERYTHING)
        assert r.kind == "path-outside" and r.path is not None
    # A link that stays inside is followed; pip is given the link's own name.
    (d / "alias-0.1-py3-none-any.whl").symlink_to(Path("wheels") / WHEEL)
    (r,) = read(d, ["./alias-0.1-py3-none-any.whl"])
    assert r.kind == "path" and r.line == str(d.resolve() / "alias-0.1-py3-none-any.whl")
    assert r.key.startswith("file alias-0.1-py3-none-any.whl sha256:")


def test_a_directory_holding_a_link_out_is_path_outside(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s3cret\n")
    d = job(tmp_path)
    pkg = d / "pkg"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text("[project]\nname='p'\n")
    (pkg / "data").symlink_to(tmp_path / "secret")
    message = refusal(d, ["./pkg"])
    assert message.startswith(
        "pip[0]: './pkg' holds a link that leads outside the job's code ('data'); "
    ), message
    assert message.endswith("--pip-allow path-outside)")
    (r,) = read(d, ["./pkg"], EVERYTHING)
    assert r.kind == "path-outside"
    # Links inside are followed, and a loop is walked once.
    (pkg / "data").unlink()
    (pkg / "data").symlink_to(d / "wheels")
    (pkg / "loop").symlink_to(".")
    (r,) = read(d, ["./pkg"])
    assert r.kind == "path" and r.line == str(pkg.resolve()) and r.key.startswith("tree sha256:")


def test_the_key_is_the_content_not_the_place(tmp_path: Path) -> None:
    one = job(tmp_path, f"./wheels/{WHEEL}\n", name="one")
    two = job(tmp_path, f"./wheels/{WHEEL}\n", name="two")
    assert basis(read(one, [])) == basis(read(two, []))  # the same wheel, two places
    moved = job(tmp_path, f"./dist/{WHEEL}\n", name="moved")
    (moved / "dist").mkdir()
    os.rename(moved / "wheels" / WHEEL, moved / "dist" / WHEEL)
    assert basis(read(moved, [])) == basis(read(one, []))
    # Another wheel under the same path: another key.
    (two / "wheels" / WHEEL).write_bytes((one / "wheels" / WHEEL).read_bytes() + b"\0")
    assert basis(read(one, [])) != basis(read(two, []))
    # The same bytes under another file name (pip reads a wheel's name): another key.
    renamed = job(tmp_path, "./wheels/ddpqtestpkg-0.1-py2.py3-none-any.whl\n", name="renamed")
    os.rename(
        renamed / "wheels" / WHEEL, renamed / "wheels" / "ddpqtestpkg-0.1-py2.py3-none-any.whl"
    )
    assert basis(read(renamed, [])) != basis(read(one, []))


def test_a_directorys_key_is_its_tree(tmp_path: Path) -> None:
    d = job(tmp_path)
    (d / "pkg" / "src").mkdir(parents=True)
    (d / "pkg" / "src" / "m.py").write_text("A = 1\n")
    first = basis(read(d, ["./pkg"]))
    other = job(tmp_path, name="other")
    (other / "elsewhere" / "src").mkdir(parents=True)
    (other / "elsewhere" / "src" / "m.py").write_text("A = 1\n")
    assert basis(read(other, ["./elsewhere/"])) == first
    (d / "pkg" / "src" / "m.py").chmod(0o755)
    assert basis(read(d, ["./pkg"])) != first
    (d / "pkg" / "src" / "m.py").chmod(0o644)
    assert basis(read(d, ["./pkg"])) == first
    (d / "pkg" / "src" / "m.py").write_text("A = 2\n")
    assert basis(read(d, ["./pkg"])) != first
    (d / "pkg" / "src" / "m.py").write_text("A = 1\n")
    (d / "pkg" / "src" / "n.py").write_text("")
    assert basis(read(d, ["./pkg"])) != first


def test_order_comments_spelling_and_duplicates_do_not_change_the_key(tmp_path: Path) -> None:
    a = job(
        tmp_path,
        f"numpy>=1.26,<2\nRequests[Socks]==2.0\n./wheels/{WHEEL}\n",
        name="a",
    )
    b = job(
        tmp_path,
        "# the same, otherwise written\n"
        f"wheels/{WHEEL}  # a wheel\n"
        "requests [socks] == 2.0\n\n"
        "numpy <2 , >=1.26\\\n"
        "\n"
        "NumPy<2,>=1.26\n",
        name="b",
    )
    assert basis(read(a, [])) == basis(read(b, []))
    assert basis(read(a, [])) == basis(
        read(
            job(tmp_path, "", name="c"),
            ["requests[socks]==2.0", f"./wheels/{WHEEL}", "numpy>=1.26,<2"],
        )
    )
    assert basis(read(a, [])) != basis(read(a, ["numpy>=1.26,<3"]))
    assert basis(read(a, [])) != basis(read(a, ["scipy"]))


def test_pip_is_given_a_file_of_the_workers_own(tmp_path: Path) -> None:
    d = job(
        tmp_path,
        "numpy>=1.26\n"
        f"./wheels/{WHEEL}\n"
        "--extra-index-url https://example.org/simple\n"
        "numpy>=1.26\n"
        "https://example.org/x-1.0-py3-none-any.whl  # a comment\n",
    )
    lines = pip_lines(read(d, ["pkg @ https://example.org/p.whl"], EVERYTHING))
    assert lines == [
        "numpy>=1.26",
        f"{d.resolve()}/wheels/{WHEEL}",
        "--extra-index-url https://example.org/simple",
        "https://example.org/x-1.0-py3-none-any.whl",
        "pkg @ https://example.org/p.whl",
    ]
    # Each line is one requirement pip reads as written: no comment, no continuation.
    assert all("\n" not in line and not line.endswith("\\") for line in lines)
    assert logical_lines("\n".join(lines)) == list(enumerate(lines, 1))


def test_a_workers_directory_a_requirements_file_cannot_name_is_refused(tmp_path: Path) -> None:
    d = job(tmp_path, f"./wheels/{WHEEL}\n", name="odd ;dir")
    message = refusal(d, [])
    assert "its place on this worker" in message and "tell the worker's operator" in message
    spaced = job(tmp_path, f"./wheels/{WHEEL}\n", name="my dir")
    (r,) = read(spaced, [])
    assert r.line == f"{spaced.resolve()}/wheels/{WHEEL}"
