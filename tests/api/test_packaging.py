"""The package as a user imports it."""
import subprocess
import sys


def test_a_checkout_named_omniattn_does_not_shadow_the_package(tmp_path):
    """A clone into a folder named `omniattn`, with Python run from its parent, must import
    the package, not the checkout as a namespace package (the src/ layout keeps them apart)."""
    (tmp_path / "omniattn" / "tests").mkdir(parents=True)
    (tmp_path / "omniattn" / "README.md").write_text("a checkout")
    code = "import omniattn; print(omniattn.attention.__module__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "omniattn.api"
