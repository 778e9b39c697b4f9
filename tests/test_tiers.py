"""KV tiers on their own: size limits, LRU order, restart of the disk tier, a real Redis coming and going."""

import os


from kvopt.tiers import DiskTier, MemoryTier, RedisTier, TierChain
from redis_server import RedisServer, free_port


def test_memory_tier_keeps_the_most_recent_within_its_limit():
    tier = MemoryTier(max_bytes=1000)
    for index in range(5):
        tier.put(f"k{index}", bytes(300))
    assert tier.get("k0") is None and tier.get("k1") is None  # the two oldest went
    assert tier.get("k2") == bytes(300)
    tier.put("k5", bytes(300))  # k3 is now the least recently used
    assert tier.contains("k2") and not tier.contains("k3")
    assert tier.stats.bytes_stored == 900 and tier.stats.evictions == 3
    tier.put("huge", bytes(2000))  # larger than the tier: not kept, nothing evicted for it
    assert not tier.contains("huge") and tier.stats.evictions == 3


def test_disk_tier_enforces_its_limit_on_disk_and_survives_a_restart(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10_000)
    for index in range(100):  # 10x the limit
        tier.put(f"{index:04x}" * 4, os.urandom(1000))
    assert tier.disk_bytes() <= 10_000 and tier.stats.evictions == 90
    kept = [f"{index:04x}" * 4 for index in range(90, 100)]
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "00ab00ab.kvb.123.456.tmp").write_bytes(b"half a write")  # a write interrupted by a crash
    again = DiskTier(tmp_path, max_bytes=10_000)  # a restarted process: the index is rebuilt from the folder
    assert all(again.contains(key) for key in kept) and again.stats.bytes_stored == 10_000
    assert not (tmp_path / "ab" / "00ab00ab.kvb.123.456.tmp").exists()
    assert again.get(kept[0]) is not None
    again.drop(kept[1])
    assert not again.contains(kept[1]) and again.get(kept[1]) is None and again.disk_bytes() == 9_000


def test_disk_tier_in_a_folder_holding_other_data_leaves_that_data_alone(tmp_path):
    """A tier pointed at a folder with other content (a home directory, a shared cache) indexes and deletes only
    its own files: ``xy/<key ending in xy>.kvb`` and its temporary files."""
    foreign = {"docs/notes.txt": b"notes", "ab/readme.tmp": b"keep", "ab/other.kvb": b"not ours", "abc/1fab.kvb": b"3"}
    for name, data in foreign.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "ab" / "nested").mkdir()  # a folder where the tier's files would be
    tier = DiskTier(tmp_path, max_bytes=2_000)
    assert tier.stats.bytes_stored == 0 and tier.disk_bytes() == 0
    for index in range(6):  # past the limit: evictions delete only the tier's own entries
        tier.put(f"{index:04x}" * 4, os.urandom(500))
    again = DiskTier(tmp_path, max_bytes=2_000)
    assert again.stats.bytes_stored == again.disk_bytes() == 2_000
    assert all((tmp_path / name).read_bytes() == data for name, data in foreign.items())


def test_disk_tier_that_cannot_write_counts_an_error_and_raises_nothing(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, max_bytes=10_000)
    (tmp_path / "cd").write_bytes(b"")  # a file where the entry's folder should be: the write fails, even for root
    tier.put("abcd", b"x" * 10)
    assert tier.stats.errors == 1 and not tier.contains("abcd")

    def full_disk(path, data):
        path.open("wb").write(data[: len(data) // 2])  # a partial write, then ENOSPC
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_bytes", full_disk)
    tier.put("cdef", b"y" * 10)
    assert tier.stats.errors == 2 and not tier.contains("cdef")
    assert tier.disk_bytes() == 0  # the partial temporary file was removed


def test_chain_promotes_hits_and_writes_everywhere_in_the_background(tmp_path):
    memory, disk = MemoryTier(10_000), DiskTier(tmp_path, 100_000)
    chain = TierChain([memory, disk])
    chain.put_later("aa11", lambda: b"block")
    chain.flush()
    assert memory.contains("aa11") and disk.contains("aa11")
    memory.close()
    found, tier = chain.get("aa11")
    assert (found, tier) == (b"block", disk) and memory.contains("aa11")  # promoted
    chain.drop("aa11")
    assert chain.get("aa11") is None
    chain.close()


def test_redis_tier_shares_blocks_and_holds_its_size_limit_under_10x_writes():
    server = RedisServer()
    try:
        writer, reader = RedisTier(server.url, max_bytes=3_000_000), RedisTier(server.url)
        writer.put("shared", b"kv")
        assert reader.get("shared") == b"kv"  # another client (a replica) sees it
        for index in range(600):  # 30 MB through a 3 MB limit
            writer.put(f"k{index}", os.urandom(50_000))
        used = server.client().info("memory")["used_memory"]
        assert used <= 3_000_000 + 60_000  # the server evicts as it goes (allkeys-lru)
        writer.refresh()
        assert writer.stats.evictions > 500 and writer.stats.errors == 0
        assert reader.get("k599") is not None
    finally:
        server.stop()


def test_redis_down_or_never_started_misses_fast_and_raises_nothing():
    never = RedisTier(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2, retry_after=60)
    assert never.get("x") is None and never.stats.errors == 1
    never.put("x", b"1")  # within retry_after: not even tried
    assert never.stats.errors == 1
    server = RedisServer()
    tier = RedisTier(server.url, timeout=0.2, retry_after=0.0)
    tier.put("x", b"1")
    server.stop()
    assert tier.get("x") is None and tier.stats.errors == 1
    tier.put("y", b"2")
    assert tier.stats.errors == 2
