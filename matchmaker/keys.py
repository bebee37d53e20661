"""The matchmaker's issuing key: the Ed25519 key that signs connect tokens.

Theory of operation
-------------------
Every introduction carries a connect token (``rudp.tokens``) signed with this
key; hosts and clients are given its *public* half and trust nothing else from
the matchmaker. Replicas share the key (the same file or environment variable
on each), never any state about it.

Where the key comes from, first match wins:

* ``--issuer-key-file PATH`` (``MATCHMAKER_ISSUER_KEY_FILE``): a file written by
  ``python -m matchmaker keygen --out PATH``;
* ``MATCHMAKER_ISSUER_KEY`` (or ``--issuer-key``, which shows in ``ps``): the
  private key in hex;
* ``--ephemeral-issuer-key``: a key made in memory at start, for development
  only. Every restart makes a new one, which every host and client must be
  given again; the startup line says ``issuer=ephemeral``.

Without any of them introductions carry no token, and hosts that require tokens
refuse every client (the startup line says ``issuer=none``).

The key file is text: comment lines (``#``) and one line with the 32-byte private
key in hex. ``keygen --out FILE`` writes it with mode 600, and the public key in
hex to ``FILE.pub``; it never overwrites a key file.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rudp.tokens import KEY_SIZE, generate_issuer_key, issuer_public_key


def parse_key(text: str) -> bytes:
    """The private key in a key file's text (or an environment variable's value)."""
    lines = [line.strip() for line in text.splitlines()]
    keys = [line for line in lines if line and not line.startswith("#")]
    if len(keys) != 1:
        raise ValueError("expected one line with the key in hex")
    try:
        raw = bytes.fromhex(keys[0])
    except ValueError:
        raise ValueError("the key is not hex") from None
    if len(raw) != KEY_SIZE:
        raise ValueError(f"the key is {len(raw)} bytes, expected {KEY_SIZE} (64 hex digits)")
    return raw


def read_key_file(path: str) -> bytes:
    """The private key in ``path``; ValueError naming the problem."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(4096)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    try:
        return parse_key(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def key_file_text(private: bytes) -> str:
    public = issuer_public_key(private).hex()
    return (
        "# matchmaker connect-token issuing key (Ed25519). Keep it secret: whoever holds\n"
        "# it can admit anyone to every host that trusts it.\n"
        f"# public key (give it to hosts and clients): {public}\n"
        f"{private.hex()}\n"
    )


def write_key_file(path: str, private: bytes) -> None:
    """Create ``path`` (mode 600) holding ``private``, and ``path.pub`` with its public
    half in hex (what hosts and clients are given); FileExistsError if ``path`` exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key_file_text(private))
    with open(path + ".pub", "w", encoding="ascii") as f:
        f.write(issuer_public_key(private).hex() + "\n")


def read_public_key(path: str) -> bytes:
    """An issuer public key from a ``.pub`` file (hex); ValueError naming the problem."""
    try:
        with open(path, encoding="ascii") as f:
            return parse_key(f.read(4096))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def keygen(argv: Sequence[str]) -> int:
    """``python -m matchmaker keygen [--out PATH] [--if-absent]``."""
    parser = argparse.ArgumentParser(
        prog="python -m matchmaker keygen",
        description="Create a connect-token issuing key pair (Ed25519).",
    )
    parser.add_argument("--out", help="write the private key to this file (mode 600)")
    parser.add_argument(
        "--if-absent", action="store_true", help="with --out: keep an existing file, print its key"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        private = generate_issuer_key()
        print(f"private {private.hex()}")
        print(f"public {issuer_public_key(private).hex()}")
        return 0
    if args.if_absent and os.path.exists(args.out):
        try:
            private = read_key_file(args.out)
        except ValueError as exc:
            print(f"matchmaker keygen: {exc}", file=sys.stderr)
            return 2
        print(f"issuing key {args.out} (public {issuer_public_key(private).hex()})")
        return 0
    private = generate_issuer_key()
    try:
        write_key_file(args.out, private)
    except OSError as exc:
        print(f"matchmaker keygen: {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"wrote a new issuing key to {args.out} (public {issuer_public_key(private).hex()})")
    print("give the public key to hosts (token_issuers) and clients (issuer_keys)")
    return 0
