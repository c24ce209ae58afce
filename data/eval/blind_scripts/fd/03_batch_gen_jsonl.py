#!/usr/bin/env python
# Batch generation over a large prompt file. Each rank writes its own jsonl shard,
# rank 0 merges them at the end.
#
#   torchrun --nproc_per_node=8 03_batch_gen_jsonl.py \
#       --model meta-llama/Llama-2-13b-chat-hf --prompts data/prompts.jsonl --out_dir gen/llama13b
import argparse
import glob
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from datasets import load_dataset, load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithPadding


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="jsonl with fields id, prompt")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--cache_dir", default=None)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_prompt_len", type=int, default=1536)
    p.add_argument("--max_new_tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--system", default="You are a helpful assistant.")
    return p.parse_args()


def build_or_load_tokenized(args, tokenizer, rank):
    cache = args.cache_dir or os.path.join(args.out_dir, "tokenized")
    if rank == 0 and not os.path.isdir(cache):
        raw = load_dataset("json", data_files=args.prompts, split="train")

        def tok(ex):
            msgs = [{"role": "system", "content": args.system},
                    {"role": "user", "content": ex["prompt"]}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            enc = tokenizer(text, truncation=True, max_length=args.max_prompt_len,
                            add_special_tokens=False)
            return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

        ds = raw.map(tok, remove_columns=[c for c in raw.column_names if c != "id"], num_proc=8)
        ds = ds.add_column("row", list(range(len(ds))))
        ds.save_to_disk(cache)
    # the other ranks wait for rank 0 to finish writing the cache
    dist.barrier()
    return load_from_disk(cache)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out_dir, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token

    # whole model on this rank's GPU
    model = AutoModelForCausalLM.from_pretrained(
        args.model, torch_dtype=torch.bfloat16, device_map={"": local_rank}
    )
    model.eval()

    ds = build_or_load_tokenized(args, tokenizer, rank)
    ids = ds["id"]
    rows = ds["row"]
    ds = ds.remove_columns(["id"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    collator = DataCollatorWithPadding(tokenizer, padding="longest")
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                        collate_fn=collator, num_workers=2)

    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    if args.temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        gen_kwargs.update(do_sample=False)

    shard_path = os.path.join(args.out_dir, f"shard_{rank:03d}.jsonl")
    n_new_tokens = 0
    t0 = time.time()
    with open(shard_path, "w") as fout, torch.no_grad():
        for step, batch in enumerate(loader):
            row = batch.pop("row").tolist()
            batch = {k: v.to(model.device) for k, v in batch.items()}
            out = model.generate(**batch, **gen_kwargs)
            new = out[:, batch["input_ids"].shape[1]:]
            n_new_tokens += int((new != tokenizer.pad_token_id).sum())
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            for r, t in zip(row, texts):
                fout.write(json.dumps({"row": r, "id": ids[r], "completion": t}) + "\n")
            fout.flush()
            if rank == 0 and step % 10 == 0:
                print(f"step {step}/{len(loader)}  {time.time() - t0:.0f}s", flush=True)

    stats = torch.tensor([n_new_tokens, len(sampler)], dtype=torch.long, device=model.device)
    dist.all_reduce(stats)
    dist.barrier()

    if rank == 0:
        merged = {}
        for path in sorted(glob.glob(os.path.join(args.out_dir, "shard_*.jsonl"))):
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    merged.setdefault(rec["row"], rec)  # sampler pads with repeats
        assert len(merged) == len(rows), f"expected {len(rows)} rows, got {len(merged)}"
        out_path = os.path.join(args.out_dir, "generations.jsonl")
        with open(out_path, "w") as f:
            for r in sorted(merged):
                rec = merged[r]
                f.write(json.dumps({"id": rec["id"], "completion": rec["completion"]}) + "\n")
        elapsed = time.time() - t0
        print(f"wrote {len(merged)} generations to {out_path}; "
              f"{stats[0].item() / elapsed:.0f} tok/s over {world} GPUs")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
