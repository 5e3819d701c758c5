"""S3 credentials by reference (store/credentials.py): env:NAME and file:PATH resolve where the
process runs; errors name the reference, never a value; the file must be private."""

from __future__ import annotations

import os

import pytest

from phalanx.errors import UnsafePathError
from phalanx.store.credentials import resolve
from phalanx.store.objectstore import parse_s3_url

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def test_env_names_a_prefix_of_variables(monkeypatch):
    monkeypatch.setenv("CLOUD_ACCESS_KEY_ID", "AKIDCLOUD")
    monkeypatch.setenv("CLOUD_SECRET_ACCESS_KEY", SECRET)
    assert resolve("env:CLOUD") == {"access_key": "AKIDCLOUD", "secret_key": SECRET}
    monkeypatch.setenv("CLOUD_SESSION_TOKEN", "tok")
    assert resolve("env:CLOUD")["session_token"] == "tok"
    monkeypatch.delenv("CLOUD_SECRET_ACCESS_KEY")
    with pytest.raises(ValueError, match="env:CLOUD: CLOUD_SECRET_ACCESS_KEY not set") as err:
        resolve("env:CLOUD")
    assert "AKIDCLOUD" not in str(err.value)


def test_a_file_must_be_private_and_hold_the_profile(tmp_path):
    path = tmp_path / "cloud.ini"
    path.write_text(f"[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = {SECRET}\n[other]\nx = 1\n")
    path.chmod(0o600)
    assert resolve(f"file:{path}") == {"access_key": "AKIDFILE", "secret_key": SECRET}
    with pytest.raises(ValueError, match=r"\[other\]: no aws_access_key_id or aws_secret_access_key"):
        resolve(f"file:{path}#other")
    with pytest.raises(ValueError, match=r"no \[gone\] section"):
        resolve(f"file:{path}#gone")
    path.chmod(0o644)
    with pytest.raises(UnsafePathError, match="mode 0644: others could read it") as err:
        resolve(f"file:{path}")
    assert SECRET not in str(err.value)
    link = tmp_path / "link.ini"
    os.symlink(path, link)
    with pytest.raises(OSError):  # O_NOFOLLOW: a link is not followed to someone's file
        resolve(f"file:{link}")


def test_a_store_url_names_the_reference_and_errors_never_show_a_secret(monkeypatch):
    monkeypatch.setenv("SITE_B_ACCESS_KEY_ID", "AKIDB")
    monkeypatch.setenv("SITE_B_SECRET_ACCESS_KEY", SECRET)
    base, kwargs = parse_s3_url("s3://lake/px?endpoint_override=http://127.0.0.1:9&credentials=env:SITE_B")
    assert base == "lake/px" and kwargs["access_key"] == "AKIDB" and kwargs["secret_key"] == SECRET
    for bad in ("env:NOPE", "vault:x", "env:"):
        with pytest.raises(ValueError) as err:
            parse_s3_url(f"s3://lake/px?credentials={bad}")
        assert "store URL 's3://lake/px?credentials=" in str(err.value) and SECRET not in str(err.value)
