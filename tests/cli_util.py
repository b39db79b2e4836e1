"""Helpers of the CLI's bad-input tests: run a command in-process and read its one line; write an input file."""
from hethub.cli.main import main


def cli_error(capsys, argv) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one bounded line on stderr."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out[-500:], err[-500:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 600, err[-1000:]
    return lines[0]


def write(tmp_path, name, text) -> str:
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)
