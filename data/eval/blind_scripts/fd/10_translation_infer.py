"""Multi-GPU translation of a test set with an NLLB / Marian model + sacreBLEU.

    torchrun --nproc_per_node 8 10_translation_infer.py \
        --model facebook/nllb-200-distilled-1.3B --src_lang deu_Latn --tgt_lang eng_Latn \
        --src data/wmt22.de --ref data/wmt22.en --out out/wmt22.de-en

Sentences are sorted by length and packed into batches by a token budget,
fairseq-style, which keeps padding small.
"""
import argparse
import json
import os
import time

import sacrebleu
import torch
import torch.distributed as dist
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--src_lang", required=True)
    ap.add_argument("--tgt_lang", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--ref", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_tokens", type=int, default=8192, help="source tokens per batch")
    ap.add_argument("--max_src_len", type=int, default=256)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--len_penalty", type=float, default=1.0)
    ap.add_argument("--log_every", type=int, default=10)
    ap.add_argument("--fp16", action="store_true")
    return ap.parse_args()


def token_batches(items, max_tokens):
    """items: list of (idx, token_ids) sorted by length; yields lists of items."""
    batch, longest = [], 0
    for it in items:
        n = len(it[1])
        if batch and max(longest, n) * (len(batch) + 1) > max_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(it)
        longest = max(longest, n)
    if batch:
        yield batch


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    tokenizer = AutoTokenizer.from_pretrained(args.model, src_lang=args.src_lang)
    dtype = torch.float16 if args.fp16 else torch.bfloat16
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, torch_dtype=dtype).to(device).eval()
    forced_bos = tokenizer.convert_tokens_to_ids(args.tgt_lang)

    with open(args.src, encoding="utf-8") as f:
        sources = [l.rstrip("\n") for l in f]

    my_idx = list(range(rank, len(sources), world_size))
    enc = tokenizer([sources[i] for i in my_idx], truncation=True,
                    max_length=args.max_src_len)["input_ids"]
    items = sorted(zip(my_idx, enc), key=lambda x: len(x[1]), reverse=True)
    batches = list(token_batches(items, args.max_tokens))
    if rank == 0:
        print(f"{len(sources)} sentences, rank0 has {len(items)} in {len(batches)} batches", flush=True)

    hyps = {}
    window_src = window_tgt = 0
    t_window = time.time()
    t0 = time.time()
    with torch.inference_mode():
        for step, batch in enumerate(batches, start=1):
            idx = [b[0] for b in batch]
            padded = tokenizer.pad({"input_ids": [b[1] for b in batch]}, return_tensors="pt")
            padded = {k: v.to(device) for k, v in padded.items()}
            out = model.generate(
                **padded,
                forced_bos_token_id=forced_bos,
                num_beams=args.beam,
                length_penalty=args.len_penalty,
                max_new_tokens=int(padded["input_ids"].shape[1] * 1.5) + 10,
            )
            texts = tokenizer.batch_decode(out, skip_special_tokens=True)
            for i, t in zip(idx, texts):
                hyps[i] = t.strip()

            window_src += int(padded["attention_mask"].sum())
            window_tgt += int((out != tokenizer.pad_token_id).sum())
            if step % args.log_every == 0:
                counts = torch.tensor([window_src, window_tgt], device=device, dtype=torch.float64)
                dist.all_reduce(counts)
                dt = time.time() - t_window
                if rank == 0:
                    print(f"step {step}/{len(batches)}  src {counts[0] / dt:.0f} tok/s  "
                          f"tgt {counts[1] / dt:.0f} tok/s (all ranks)", flush=True)
                window_src = window_tgt = 0
                t_window = time.time()

    parts = [None] * world_size
    dist.all_gather_object(parts, hyps)

    if rank == 0:
        merged = {}
        for p in parts:
            merged.update(p)
        assert len(merged) == len(sources), (len(merged), len(sources))
        hyp_list = [merged[i] for i in range(len(sources))]
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".hyp", "w", encoding="utf-8") as f:
            f.write("\n".join(hyp_list) + "\n")
        summary = {"model": args.model, "n": len(hyp_list), "seconds": round(time.time() - t0, 1)}
        if args.ref:
            with open(args.ref, encoding="utf-8") as f:
                refs = [l.rstrip("\n") for l in f]
            bleu = sacrebleu.corpus_bleu(hyp_list, [refs])
            chrf = sacrebleu.corpus_chrf(hyp_list, [refs])
            summary.update(bleu=round(bleu.score, 2), chrf=round(chrf.score, 2),
                           signature=str(bleu.format(signature=True)))
            print(bleu.format(), "|", chrf.format())
        with open(args.out + ".json", "w") as f:
            json.dump(summary, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
