"""`llmcluster data prepare|merge|verify`: tokenizer + token shards under datasets/<kind>/<name>/."""

from __future__ import annotations

from llmcluster.cli.common import add_actions, add_root_arg
from llmcluster.data.sources import MAX_RECORD_BYTES


def register(sub) -> None:
    dsub = add_actions(sub, "data", "prepare datasets: tokenize corpora into checksummed token shards")
    prep = dsub.add_parser("prepare", help="tokenize sources into datasets/<kind>/<name>/")
    prep.add_argument("--source", nargs="+", metavar="PATH",
                      help="files, directories, .jsonl[.gz|.zst] / .parquet corpora or saved `datasets` "
                           "directories (default: the Python standard library's own source)")
    prep.add_argument("--format", choices=("text", "chat"), default="text",
                      help="chat: records of {role, content} messages, rendered with the tokenizer's chat "
                           "template; only assistant tokens are trained")
    prep.add_argument("--text-field", default=None,
                      help="the record field holding a document (default: text; with --format chat: messages)")
    prep.add_argument("--name", default="stdlib", help="dataset name (default: stdlib)")
    prep.add_argument("--kind", choices=("code", "text"), default="code")
    prep.add_argument("--tokenizer", default="bpe:4096", metavar="bpe:N|byte|PATH",
                      help="train a byte-level BPE of N tokens, use raw bytes, or an HF model directory / "
                           "tokenizer.json")
    prep.add_argument("--tokenizer-sample-bytes", type=int, default=100_000_000,
                      help="train the BPE on the first this many bytes of the sources")
    prep.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    prep.add_argument("--shard", metavar="I/N", help="prepare slice I of N (then `data merge`)")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out")
    prep.add_argument("--shard-tokens", type=int, default=16 * 1024 * 1024, help="tokens per shard")
    prep.add_argument("--max-bytes", type=int, default=None, help="stop reading sources after this many bytes")
    prep.add_argument("--max-record-bytes", type=int, default=MAX_RECORD_BYTES, metavar="N",
                      help="refuse a document (record, file) or rendered conversation larger than this "
                           "(default: 64 MiB)")
    prep.add_argument("--seed", type=int, default=1337)
    prep.add_argument("--force", action="store_true", help="rebuild the dataset if it exists")
    add_root_arg(prep)
    prep.set_defaults(func=run)
    for action, help_, force in (("merge", "seal the slices of `prepare --shard` into one dataset",
                                  "replace the dataset if it exists"),
                                 ("verify", "check a prepared dataset's shards against their checksums", None)):
        a = dsub.add_parser(action, help=help_)
        a.add_argument("--name", default="stdlib")
        a.add_argument("--kind", choices=("code", "text"), default="code")
        if force:
            a.add_argument("--force", action="store_true", help=force)
        add_root_arg(a)
        a.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.config.cluster_load import storage_root

    root = storage_root(args.root)
    if args.data_cmd == "verify":
        from llmcluster.data.dataset import verify_cli

        return verify_cli(args, root)
    from llmcluster.data import prepare

    return (prepare.prepare_cli if args.data_cmd == "prepare" else prepare.merge_cli)(args, root)
