"""Every named limit of straw, with the reason for its value.

Names follow ``<NOUN>_<UNIT>_MAX``. Relations between limits are checked when
this module is imported, so an edit that breaks one fails at once. Tests may
shrink limits on the objects that use them (stores take most of them as
constructor arguments) to reach "pack full" or "record too large" in a few
operations; the module constants are the defaults.
"""

from __future__ import annotations

from .errors import invariant

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Records ------------------------------------------------------------------

#: Largest payload of one record. 16 GiB covers the largest single tensors RL pipelines
#: ship (routing replay of long rollouts); the bound is real because the record's chunk
#: table must fit an index frame (checked below). ``SharedFilesystemStore(max_record_bytes=)``
#: is kept for compatibility and is not a smaller cap (the peer ignores it too).
RECORD_BYTES_MAX = 16 * GiB

#: Largest canonical-JSON encoding of one task's metadata: it is journaled with the call that
#: names it (a journal frame body holds at most 4 GiB) and kept in the queue's memory.
#: (Limits.metadata_bytes is an identity field of a queue, not this bound.)
TASK_METADATA_BYTES_MAX = 1 * GiB

#: Longest record id in UTF-8 bytes: ids are names, not payloads, and every id
#: is repeated in the pack index.
RECORD_ID_BYTES_MAX = 1 * KiB

#: Longest codec name in UTF-8 bytes.
CODEC_NAME_BYTES_MAX = 64

#: Largest canonical-JSON encoding of one record's metadata. It travels in the index frame
#: of its pack (at most INDEX_BYTES_MAX) and in memory with every read of the record; the
#: peer library takes tens of MiB, so the bound sits well above that. (Limits.metadata_bytes
#: is an identity field of a queue, not this bound.)
METADATA_BYTES_MAX = 64 * MiB

#: Index row parts of record metadata texts remembered per process (``frame.text_pairs``):
#: the records of a write often repeat one metadata (the tensors of a sample, the records of a
#: task's result), so each distinct text is parsed once. Only texts of at most
#: METADATA_ROW_TEXT_CACHED_MAX characters are kept: at most 4 Mi characters of text in all.
METADATA_ROWS_CACHED = 1024
METADATA_ROW_TEXT_CACHED_MAX = 4 * KiB

#: Checked tensor descriptions remembered per process (``tensor._description``), by their
#: canonical bytes, codec and byte count: the tensors of a batch share a few (dtype, shape,
#: kind), so each is decoded and checked once, not once per tensor read. Small tuples.
TENSOR_DESCRIPTIONS_CACHED = 4096

#: Most records in one durable write. Bounds the index frame a reader must parse.
RECORDS_PER_WRITE_MAX = 1_000_000

#: Most dependencies of one publication. Its manifest, with every dependency's reference,
#: travels inline in the index frame (at most INDEX_BYTES_MAX; about 600 bytes each).
DEPENDENCIES_MAX = 1_000_000

#: Longest submission id in UTF-8 bytes.
SUBMISSION_ID_BYTES_MAX = 1 * KiB

#: Largest value for a record's token count (signed 64-bit range).
TOKENS_MAX = 2**63 - 1

# Packs ---------------------------------------------------------------------

#: Payload chunk covered by one checksum. 256 KiB keeps a verified row slice
#: cheap (at most two chunks hashed at ~28 GiB/s, a few microseconds each)
#: while a 1 GiB record needs only 4,096 checksums (32 KiB of index).
CHUNK_BYTES = 256 * KiB

#: Largest index frame body. An index lists every record of one write with its
#: metadata and chunk checksums; 1 GiB bounds what a reader will allocate for
#: a (possibly corrupt) length field.
INDEX_BYTES_MAX = 1 * GiB

#: Largest pack file a reader accepts an offset into (2**62): offsets are
#: stored as unsigned 64-bit values and Python's pread takes signed ones.
PACK_BYTES_MAX = 2**62

#: Zeros a pack keeps written ahead of small appends (DURABILITY.md D1.2a): the appends then
#: overwrite allocated blocks and their fdatasync commits no size change. Only extents up to
#: a quarter of this take part, so bulk writes are never doubled.
PACK_PREALLOC_BYTES = 1 * MiB

#: Default rotation threshold of a pack (API.md section 5: segment_target_bytes).
SEGMENT_TARGET_BYTES_DEFAULT = 1 * GiB

#: Default cap on memory the store may buffer on its own behalf.
BUFFER_BYTES_MAX_DEFAULT = 512 * MiB

# I/O -----------------------------------------------------------------------

#: Largest count handed to one read or write system call. Linux transfers at
#: most 0x7FFFF000 bytes per call; staying below keeps every short transfer a
#: real end-of-file or error instead of a kernel cap.
SYSCALL_BYTES_MAX = 1 * GiB

#: Smallest read buffer that gets an anonymous mapping of its own instead of the allocator's
#: memory (``tensor.read_buffer``). NumPy asks for transparent huge pages from 4 MiB on, and a
#: huge page on a host with fragmented free memory waits for compaction; below this size a
#: mapping each would also spend the process's map entries (``vm.max_map_count``) on small tensors.
READ_MAPPING_BYTES_MIN = 4 * MiB

#: A sample document stores a list of this many ints or floats or more packed (binary in base64,
#: docs/FORMAT.md section 10.5) instead of as JSON numbers. Below it JSON is as quick and stays
#: readable in ``straw inspect``; a 4096-token response's log-probs encode in 0.1 ms packed
#: against 1.9 ms as JSON, and decode in 0.13 against 1.2 ms.
PACKED_LIST_ITEMS_MIN = 64

#: Dataclass types whose field names and getter the sample codec keeps between publications
#: (the types a process publishes; a long-lived process that defines classes on the fly
#: recomputes the least recently used).
DATACLASS_LAYOUTS_CACHED = 256

#: A write larger than this goes down in slices of this size, each handed to the kernel's
#: writeback as soon as it is written (``posix.pwrite_all``), so the disk works while the next
#: slice is copied and the extent's ``fdatasync`` waits only for the tail. Measured on ext4 with
#: four writers of 52 MiB extents: 2.8-3.7 s -> 2.0-2.3 s; 4-16 MiB slices all do about as well.
WRITEBACK_SLICE_BYTES = 8 * MiB

#: Most buffers in one vectored write (POSIX IOV_MAX is 1024 on Linux).
IOVEC_COUNT_MAX = 1024

#: Open pack file descriptors one reader keeps cached.
OPEN_PACKS_MAX = 64

#: Open pack descriptors all the readers of one process keep cached together (DURABILITY.md
#: D5.2c), or half the process's descriptor limit (RLIMIT_NOFILE) when that is lower. Every
#: thread has read sessions of its own (a store's, straw.tensor's), each caching up to
#: OPEN_PACKS_MAX: without a shared bound, 16 threads reading many packs use up the usual
#: limit of 1024. A reader about to open a pack past the bound first closes its own least
#: recently used ones (never another reader's: a read in another thread may be using it).
OPEN_PACKS_PROCESS_MAX = 1024

#: Open pack descriptors a reader keeps however many the process's other readers hold, so
#: each thread's reads still find their current packs open (a batch read touches several).
OPEN_PACKS_READER_MIN = 4

#: Index entries (records and manifests) of the parsed index frames one reader keeps, most
#: recently used last: counted in entries, not frames, since one ``publish_many`` frame may
#: hold thousands. An entry is kept as one tuple of plain values (``frame.Row``, about 0.6 KB
#: with its strings), which the cycle collector untracks, so the cache costs memory, not
#: collector time. A validating reader (``shared=True``) keeps here only what it read itself.
INDEX_CACHE_ENTRIES_MAX = 16384

#: Bytes of the index frames shared by every reader of the process (``reader.SHARED_INDEXES``:
#: what its stores wrote or verified), as CPython's object sizes count a kept frame's rows and
#: their items (by their lengths), estimated from its first and last rows. Bounded in bytes, not
#: entries: ten thousand publications of one small record (20k entries, about 11 MB by that
#: count) fit, so validating them again in the order they were written re-reads no frame, while
#: entries with more metadata count for what they hold (some 18k result entries of a task and
#: an attempt id each). A frame whose middle rows are larger than its first and last is counted
#: low; even then no row counts under 440 bytes, so at worst this bounds some 28k entries.
SHARED_INDEX_BYTES_MAX = 12 * MiB

#: Record sets a read session remembers having verified (each verified once per session).
#: An entry is one tracked object when the set's records share one extent (the set's located
#: records are rebuilt from the shared index when asked), more only for sets spread over
#: several extents: 4096 of them cost a full cycle collection a few milliseconds at most.
RECORD_SETS_CACHED_MAX = 4096

#: Record sets the stores of one process published and remember resolved, for every session
#: of that process (FORMAT.md section 5, "Record sets this process wrote"); oldest first out.
#: Kept as RECORD_SETS_CACHED_MAX's entries are; 4096 covers what the validating coordinator
#: of a process running dozens of workers that publish 64 results at a time meets in flight.
WRITTEN_SETS_CACHED_MAX = 4096

#: Delays (seconds) between attempts to open a file that is not yet visible
#: (a shared mount's metadata can lag by a moment). The sum, ~4 s, bounds how
#: long a read waits before raising StorageUnavailable.
VISIBILITY_RETRY_DELAYS = (0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)

#: Submission ids one store instance remembers for idempotent retries. Older
#: ids are forgotten first; a retry of a forgotten id writes a new, logically
#: identical copy (same digest), never different data.
SUBMISSIONS_REMEMBERED_MAX = 1_000_000

#: References one store instance remembers across those submissions (a ``publish_many`` of
#: 64 publications remembers 64): a worker publishing a million results would otherwise keep
#: every answer for retries that come within seconds of the call. Oldest submissions go
#: first; the newest is always kept. An answer is kept as its extent's SegmentRef plus a
#: tuple of plain values per reference (``store._Remembered``, some 200 bytes each, untracked
#: by the cycle collector), and rebuilt on a retry.
SUBMITTED_REFS_REMEMBERED_MAX = 16384

# Tensors and the sample codec -------------------------------------------------

#: Most dimensions of a stored tensor (PyTorch's own limit is 64 too).
TENSOR_DIMS_MAX = 64

#: Longest tensor kind name in UTF-8 bytes.
KIND_BYTES_MAX = 256

#: Pools ``straw.tensor`` keeps attached on its own (a reference's root, a store passed as
#: ``reader=``), each with read sessions holding up to OPEN_PACKS_MAX descriptors per thread
#: (all readers of the process together: OPEN_PACKS_PROCESS_MAX).
#: Past it the least recently attached is forgotten (re-attached by its next read); pools
#: named by ``attach()`` or STRAW_POOL_ROOTS do not count and stay.
ATTACHED_POOLS_MAX = 16

#: Writer directories remembered per process as "found in this attached pool" (a cache:
#: forgetting costs one stat per attached pool on the next read of that writer's packs).
WRITERS_CACHED_MAX = 65536

#: Deepest nesting of containers the codec stores or reads, and of JSON values the queue
#: journals (metadata, producer states). Samples nest a few levels; the bound keeps encoding
#: and decoding far from Python's recursion limit.
NESTING_DEPTH_MAX = 100

#: Largest byte string kept inside the codec's JSON document (base64); longer ones become records.
INLINE_BYTES_MAX = 1024

#: Longest record id derived from a path (ids are names; the full path is in the document).
PART_ID_BYTES_MAX = 256

# Relations -----------------------------------------------------------------

invariant(CHUNK_BYTES > 0 and CHUNK_BYTES % 4096 == 0, "chunks are whole pages")
invariant(SYSCALL_BYTES_MAX < 0x7FFFF000, "one syscall never hits the Linux transfer cap")
invariant(WRITEBACK_SLICE_BYTES <= SYSCALL_BYTES_MAX, "a writeback slice is one syscall")
invariant(CHUNK_BYTES <= SYSCALL_BYTES_MAX, "a chunk is read by one syscall")
invariant(RECORD_BYTES_MAX < PACK_BYTES_MAX, "a record fits in a pack")
invariant(METADATA_BYTES_MAX < INDEX_BYTES_MAX, "one record's metadata fits an index")
invariant(RECORD_BYTES_MAX // CHUNK_BYTES * 16 < INDEX_BYTES_MAX, "chunk table of the largest record fits")
invariant(sum(VISIBILITY_RETRY_DELAYS) < 10, "a read never waits more than a few seconds")
invariant(INLINE_BYTES_MAX < METADATA_BYTES_MAX, "inline codec bytes stay small next to metadata")
invariant(PART_ID_BYTES_MAX <= RECORD_ID_BYTES_MAX, "codec part ids are valid record ids")

# Queue journal ----------------------------------------------------------------

#: Journal bytes written since the last snapshot before the coordinator writes a
#: new one. The real threshold is the larger of this and the last snapshot's
#: size, so snapshot work stays proportional to journal work (each journal byte
#: is copied into a snapshot at most about once). Small because what finished
#: since the last snapshot is the only history the live state holds (each
#: snapshot moves it to a history file, DURABILITY.md J5 H1) and a snapshot is
#: cheap: a copy under the lock proportional to live work (J5.1), the rest off
#: it. 8 MiB is about 12k completed tasks (about 670 journal bytes each with
#: acquire(64)): at 100k tasks it took live RSS from 753 MiB (64 MiB) to 287;
#: smaller would add history files (one per snapshot) and rewrite the live
#: state more often for little memory (docs/QUEUE.md "Snapshots and memory").
JOURNAL_SNAPSHOT_BYTES_MIN = 8 * MiB

#: Largest JSON text ``protocol.decode`` hands to orjson (about twice as fast as the json
#: module, more with its per-number float check); its guard copies the text once, so a
#: larger one (a big snapshot) takes the json module's path and no transient copy.
JSON_FAST_DECODE_BYTES_MAX = 16 * MiB

#: Items of a list or dict that one call of the C JSON encoder encodes when a snapshot body is
#: encoded in the background (``protocol.encode_pieces``): the encoder holds the GIL for a
#: whole call, and a snapshot's tables hold tens of thousands of rows, so encoded in one call
#: they stopped every caller for tens of milliseconds. 1024 task rows take well under a
#: millisecond; each piece costs one more Python-level join.
JSON_ITEMS_PER_CALL_MAX = 1024

#: Entries (receipts, submission ids, tasks) the live state forgets per call once a history
#: file holds them (J5 H3): the work is spread over calls, so none waits long behind it.
HISTORY_FORGET_PER_CALL = 1024

#: Rows per compressed block of a history file (docs/FORMAT.md 8.4): a lookup reads and
#: inflates one block; neighbouring receipts share segments and compress well together.
HISTORY_BLOCK_ROWS = 64

#: History files a lookup searches one by one (their hashes in memory) before the snapshot
#: thread writes them into an index run (docs/FORMAT.md 8.5; ``straw._queue.history.History``):
#: a miss (every new task and submission id) then probes the runs' filters plus at most this
#: many files, instead of every file (some 115 per million tasks).
HISTORY_UNMERGED_FILES_MAX = 4

#: Entries of a history index run's page (docs/FORMAT.md 8.5): a lookup reads one page
#: (4 KiB) of a run on disk, checked against its checksum, where the run's memory keeps only
#: each page's first hash and checksum (16 bytes per page, 1/16 byte per entry).
HISTORY_RUN_PAGE_ENTRIES = 256

#: Bits per key of a run's membership filter, and the probes each key sets: a miss (every new
#: task, submission and request id) then reads no page of a run in about 99 cases out of 100,
#: for 1.25 bytes of memory per key (issue 12: the in-memory merged index held 16).
HISTORY_RUN_FILTER_BITS = 10
HISTORY_RUN_FILTER_PROBES = 4

#: Entries (tasks, submissions and requests together) of one history index run at most: the
#: snapshot thread builds a run in memory before writing it (about 40 bytes per entry at
#: most), so this bounds that transient; runs below it are merged as they double (a lookup
#: probes one filter per run: one full run per million tasks or so, plus a few small ones).
HISTORY_RUN_ENTRIES_MAX = 1 << 21

#: Descriptors of history files a process keeps open at once, the most recently read ones; the
#: others are closed and reopened at their next read (index runs keep theirs: a few per million
#: tasks, and an absorbed run's file may be deleted while it is read, J5 H3). A walk over every file
#: (paging ``read_commits`` through history, a retire, a collection) would otherwise keep one
#: per file: over a thousand at ten million tasks, past the common per-process limit of 1024.
HISTORY_OPEN_FILES_MAX = 64

#: Catalog log size after which its lock holder compacts it into a snapshot and a new log
#: (the real threshold is the larger of this and twice the last snapshot, docs/GC.md G7).
CATALOG_COMPACT_BYTES_MIN = 16 * MiB

#: Zeros written ahead of a journal segment's frames (J1.1): appends then overwrite allocated
#: blocks, so each fdatasync flushes data without committing a size change.
JOURNAL_PREALLOC_BYTES = 4 * MiB

#: Zero bytes the newest file of a log (a journal's last segment, the catalog log) always
#: holds after its last frame (DURABILITY.md J7): the zeros ahead of an append are written and
#: synced before it, so a file that ends with fewer was cut short, which no crash can do.
#: 64 is one frame header: frame headers and JSON bodies never hold that many zeros in a row.
LOG_END_ZEROS_MIN = 64

#: Zeros a clean close keeps after the last frame of a log (the rest of the space written
#: ahead is cut): comfortably more than LOG_END_ZEROS_MIN, one page.
LOG_CLOSE_ZEROS = 4 * KiB

#: Zeros written ahead of the catalog log's frames (J7, G3): small, because every catalog
#: client reads the log from its last position to the end of the file when it takes the lock.
CATALOG_PREALLOC_BYTES = 64 * KiB

#: Journal syncs allowed in flight at once (J2.4). Two lets the next batch be written and
#: synced while the previous batch's sync runs; fdatasync calls on one file overlap in the
#: kernel, so a caller waits about one sync instead of one and a half.
JOURNAL_SYNCS_IN_FLIGHT = 2

#: Frames the same thread may frame in a row, after another thread framed one, before the
#: group-commit leader stops yielding to let others join its batch (J2.2): a lone caller
#: (one worker, a Ray actor) then commits without a scheduler yield per call.
JOURNAL_COMPANY_APPENDS = 8

#: Publications a coordinator may have taken over before it records the end of their
#: staging in the catalog (docs/GC.md "Queue adoption"). Until then the queue's own owner
#: keeps them, so the delay changes nothing a collector decides; the bound keeps the
#: pending list, and the catalog frame that records it, small.
ADOPTIONS_PENDING_MAX = 4096

#: Completions one ``complete_tasks`` call may carry: they are one journal transaction (one
#: frame of about a kilobyte each), so a batch stays a frame that replay reads in one piece.
COMPLETIONS_PER_CALL_MAX = 16384

#: Largest request body the control transport (straw.rpc) reads: control messages only,
#: but a task's metadata may be large (TASK_METADATA_BYTES_MAX bounds one task; a request of
#: many tasks is bounded here, so one client cannot make the server buffer without end).
RPC_REQUEST_BYTES_MAX = 256 * MiB

#: Seconds a control-transport connection may stay silent before the server drops it.
RPC_SOCKET_SECONDS = 30.0

#: Longest queue, task, worker, producer, consumer, batch, checkpoint, request or submission
#: id in UTF-8 bytes. Ids are names: each is journaled and repeated in snapshots.
QUEUE_ID_BYTES_MAX = 1 * KiB

#: Largest canonical-JSON producer state (``submit_tasks(producer_state=...)``): a dataset
#: cursor, not a dataset. Journaled with its submit and copied into every snapshot.
PRODUCER_STATE_BYTES_MAX = 1 * MiB

#: Longest ``fail_task`` failure text in UTF-8 bytes: a reason, kept with the task for good.
FAILURE_BYTES_MAX = 64 * KiB

invariant(HISTORY_RUN_PAGE_ENTRIES <= HISTORY_RUN_ENTRIES_MAX, "a run holds at least one page")
invariant(1 <= HISTORY_RUN_FILTER_PROBES <= HISTORY_RUN_FILTER_BITS, "a filter probes a few bits per key")
invariant(HISTORY_OPEN_FILES_MAX >= 1, "the history file just read keeps its descriptor")
invariant(4 * MiB >= METADATA_ROWS_CACHED * METADATA_ROW_TEXT_CACHED_MAX, "the metadata memo stays small")
invariant(1 * MiB <= JOURNAL_SNAPSHOT_BYTES_MIN, "snapshots are not taken after every few calls")
invariant(
    LOG_END_ZEROS_MIN <= LOG_CLOSE_ZEROS < CATALOG_PREALLOC_BYTES // 2, "a closed log keeps its end zeros"
)
invariant(2 * LOG_CLOSE_ZEROS <= JOURNAL_PREALLOC_BYTES, "zeros written ahead cover the end zeros")
