"""The sealed block format on its own (`block_format.BlockSealer`): what opens, what does not,
and nonces that never repeat under one key. The tiers' tests show it against real stores."""

from __future__ import annotations

import os
import threading

import pytest

from kvtier_async.block_format import SEAL_MAGIC, SEAL_OVERHEAD, SEALS_PER_SALT, BlockSealer
from kvtier_async.buffers import new_buffer
from kvtier_async.secret import new_secret

SECRET = new_secret().encode()
NAMESPACE = "team-a/llama3-8b-bf16"
PAYLOAD_BYTES = 4096
SALT = slice(len(SEAL_MAGIC), len(SEAL_MAGIC) + 16)
NONCE = slice(len(SEAL_MAGIC) + 16, len(SEAL_MAGIC) + 28)


def sealed(sealer: BlockSealer, payload: bytes, key: bytes) -> memoryview:
    value = new_buffer(SEAL_OVERHEAD + len(payload))
    sealer.seal_into(value, memoryview(payload), key)
    return value


def opened(
    sealer: BlockSealer, value: memoryview | bytes, key: bytes, nbytes: int = PAYLOAD_BYTES
) -> bytes | None:
    block = new_buffer(nbytes)
    return bytes(block) if sealer.open_into(block, memoryview(value), key) else None


def test_a_value_opens_under_its_key_in_another_instance_of_the_secret() -> None:
    payload = os.urandom(PAYLOAD_BYTES)
    value = sealed(BlockSealer(SECRET, NAMESPACE), payload, b"k1")
    assert opened(BlockSealer(SECRET, NAMESPACE), value, b"k1") == payload


def test_what_does_not_open() -> None:
    writer = BlockSealer(SECRET, NAMESPACE)
    payload = os.urandom(PAYLOAD_BYTES)
    value = bytes(sealed(writer, payload, b"k1"))
    assert opened(writer, value, b"k2") is None  # under another key
    assert opened(BlockSealer(SECRET, "team-b/llama3-8b-bf16"), value, b"k1") is None  # namespace
    assert opened(BlockSealer(new_secret().encode(), NAMESPACE), value, b"k1") is None  # secret
    assert opened(writer, value, b"k1", PAYLOAD_BYTES - 1) is None  # another length
    for at in (0, SALT.start, NONCE.start, SEAL_OVERHEAD // 2 + 17, len(value) - 1):
        flipped = bytearray(value)
        flipped[at] ^= 1
        assert opened(writer, bytes(flipped), b"k1") is None, at


def test_nothing_of_the_namespace_key_or_payload_is_in_clear() -> None:
    sealer = BlockSealer(SECRET, NAMESPACE)
    payload = bytes(PAYLOAD_BYTES)  # all zeros: any of it in clear would show
    key = os.urandom(32)
    value = bytes(sealed(sealer, payload, key))
    name = sealer.name(key)
    for clear in (NAMESPACE.encode(), key):
        assert clear not in value and clear not in name
    assert bytes(64) not in value[len(SEAL_MAGIC) + 28 :]
    # Names are keyed: the same for every instance of the secret, another under another secret.
    assert BlockSealer(SECRET, NAMESPACE).name(key) == name
    assert BlockSealer(new_secret().encode(), NAMESPACE).name(key) != name


def test_a_writer_draws_a_fresh_salt_after_seals_per_salt_values() -> None:
    sealer = BlockSealer(SECRET, NAMESPACE, seals_per_salt=2)
    payloads = [os.urandom(PAYLOAD_BYTES) for _ in range(5)]
    values = [sealed(sealer, payload, b"k%d" % i) for i, payload in enumerate(payloads)]
    salts = [bytes(value[SALT]) for value in values]
    nonces = [int.from_bytes(value[NONCE], "little") for value in values]
    assert salts[0] == salts[1] != salts[2] == salts[3] != salts[4]
    assert len(set(salts)) == 3
    assert nonces == [0, 1, 0, 1, 0]
    reader = BlockSealer(SECRET, NAMESPACE)
    assert [opened(reader, value, b"k%d" % i) for i, value in enumerate(values)] == payloads


def test_the_default_bound_is_nists_for_one_gcm_key() -> None:
    assert SEALS_PER_SALT == 2**32
    with pytest.raises(ValueError, match="seals_per_salt"):
        BlockSealer(SECRET, NAMESPACE, seals_per_salt=2**32 + 1)
    with pytest.raises(ValueError, match="seals_per_salt"):
        BlockSealer(SECRET, NAMESPACE, seals_per_salt=0)


def test_threads_sealing_at_once_never_share_a_salt_and_nonce() -> None:
    # Many threads, a salt every 3 values: the writer moves on while others still seal under
    # the salt before; every (salt, nonce) pair must still be used once, and every value open.
    sealer = BlockSealer(SECRET, NAMESPACE, seals_per_salt=3)
    per_thread, threads = 200, 8
    values: list[list[memoryview]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def seal(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            values[t].append(sealed(sealer, b"%d.%d" % (t, i) * 8, b"k%d.%d" % (t, i)))

    workers = [threading.Thread(target=seal, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    pairs = [bytes(value[SALT]) + bytes(value[NONCE]) for row in values for value in row]
    assert len(pairs) == threads * per_thread
    assert len(set(pairs)) == len(pairs)
    assert all(int.from_bytes(value[NONCE], "little") < 3 for row in values for value in row)
    reader = BlockSealer(SECRET, NAMESPACE)
    for t, row in enumerate(values):
        for i, value in enumerate(row):
            payload = b"%d.%d" % (t, i) * 8
            assert opened(reader, value, b"k%d.%d" % (t, i), len(payload)) == payload


def salt_nonce_pairs(sealer: BlockSealer, n: int) -> list[bytes]:
    return [
        bytes(value[SALT]) + bytes(value[NONCE])
        for value in (sealed(sealer, b"x" * 64, b"k") for _ in range(n))
    ]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_and_its_parent_never_share_a_salt_and_nonce() -> None:
    # Attack: a sealer used before fork() (a pre-fork server, multiprocessing's "fork"), then in
    # both processes: the same salt and count in each would seal two blocks under one nonce.
    sealer = BlockSealer(SECRET, NAMESPACE)
    before = salt_nonce_pairs(sealer, 3)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its pairs to the parent, then gone without running the parent's exit code
        try:
            os.close(read_end)
            os.write(write_end, b"".join(salt_nonce_pairs(sealer, 5)))
        finally:
            os._exit(0)
    os.close(write_end)
    parent = salt_nonce_pairs(sealer, 5)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0
    child = [data[i : i + 28] for i in range(0, len(data), 28)]
    assert len(child) == 5
    pairs = before + parent + child
    assert len(set(pairs)) == len(pairs)
    # The child sealed under a salt of its own, counting from nonce 0; the parent went on.
    assert {pair[:16] for pair in child}.isdisjoint(pair[:16] for pair in before + parent)
    assert [int.from_bytes(pair[16:], "little") for pair in child] == list(range(5))
    assert [int.from_bytes(pair[16:], "little") for pair in parent] == list(range(3, 8))


def test_a_writer_of_another_pid_is_replaced_before_the_next_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # Attack: a fork that runs no Python fork hook (one made in C): the pid check per value
    # still gives the new process a salt of its own.
    sealer = BlockSealer(SECRET, NAMESPACE)
    first = salt_nonce_pairs(sealer, 2)
    monkeypatch.setattr(os, "getpid", lambda: -1)
    after = salt_nonce_pairs(sealer, 2)
    assert first[0][:16] != after[0][:16]
    assert [int.from_bytes(pair[16:], "little") for pair in after] == [0, 1]
    reader = BlockSealer(SECRET, NAMESPACE)
    value = sealed(sealer, b"y" * 64, b"k9")
    assert opened(reader, value, b"k9", 64) == b"y" * 64
