"""Teach NLLB-200 3.3B a new language code (pdc_Latn, Pennsylvania Dutch) with DeepSpeed ZeRO-3.

The new code's embedding row starts as a copy of deu_Latn. The model is built under
zero.Init (HfDeepSpeedConfig), so weights are partitioned from the moment they are loaded.

deepspeed --num_gpus 8 13_nllb_new_langcode_zero3.py --train data/pdc/train.jsonl --dev data/pdc/dev.jsonl
"""
import argparse
import json
import math
import os

import deepspeed
import sacrebleu
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq
from transformers.integrations import HfDeepSpeedConfig

NEW_CODE, INIT_FROM = "pdc_Latn", "deu_Latn"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="facebook/nllb-200-3.3B")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--micro-bsz", type=int, default=4)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--out", default="ckpt/nllb33-pdc")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


class Jsonl(Dataset):
    """rows: {"src_lang": "eng_Latn", "tgt_lang": "pdc_Latn", "src": ..., "tgt": ...}"""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            self.rows = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def encode_rows(tok, rows, max_len):
    feats = []
    for r in rows:
        tok.src_lang, tok.tgt_lang = r["src_lang"], r["tgt_lang"]
        e = tok(r["src"], text_target=r["tgt"], max_length=max_len, truncation=True)
        feats.append({"input_ids": e["input_ids"], "attention_mask": e["attention_mask"], "labels": e["labels"]})
    return feats


def build_ds_config(args, world, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.micro_bsz * args.accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-8,
                                                   "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": max(1, total_steps // 20),
                                 "total_num_steps": total_steps}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_prefetch_bucket_size": 5e7,
        },
        "steps_per_print": 200,
    }


@torch.no_grad()
def evaluate(engine, tok, dev, args, rank, world):
    engine.eval()
    items = list(enumerate(dev.rows))
    sampler = DistributedSampler(items, shuffle=False)   # pads, so all ranks call generate() equally often
    mine = []
    for batch in DataLoader(items, batch_size=8, sampler=sampler, collate_fn=lambda b: b):
        # NLLB's src_lang is per call; group rows by direction inside the batch
        for i, r in batch:
            tok.src_lang = r["src_lang"]
            enc = tok(r["src"], return_tensors="pt", truncation=True, max_length=args.max_len).to(engine.device)
            out = engine.module.generate(**enc, forced_bos_token_id=tok.convert_tokens_to_ids(r["tgt_lang"]),
                                         num_beams=4, max_new_tokens=args.max_len, synced_gpus=True)
            mine.append((i, tok.decode(out[0], skip_special_tokens=True)))
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    engine.train()
    hyp = {}
    for p in parts:
        hyp.update(p)
    scores = {}
    for direction in sorted({(r["src_lang"], r["tgt_lang"]) for r in dev.rows}):
        ids = [i for i, r in enumerate(dev.rows) if (r["src_lang"], r["tgt_lang"]) == direction]
        h = [hyp[i] for i in ids]
        ref = [dev.rows[i]["tgt"] for i in ids]
        scores["-".join(direction)] = sacrebleu.corpus_chrf(h, [ref], word_order=2).score
    return scores


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train, dev = Jsonl(args.train), Jsonl(args.dev)
    steps_per_epoch = len(train) // (args.micro_bsz * world) // args.accum
    ds_config = build_ds_config(args, world, steps_per_epoch * args.epochs)
    dschf = HfDeepSpeedConfig(ds_config)  # must stay alive while the model is built

    # every rank extends its own tokenizer the same way, so ids agree everywhere
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.add_special_tokens({"additional_special_tokens": tok.additional_special_tokens + [NEW_CODE]},
                           replace_additional_special_tokens=False)
    new_id, init_id = tok.convert_tokens_to_ids(NEW_CODE), tok.convert_tokens_to_ids(INIT_FROM)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=8)
    emb = model.get_input_embeddings()
    with deepspeed.zero.GatheredParameters(emb.weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                emb.weight[new_id].copy_(emb.weight[init_id])

    collator = DataCollatorForSeq2Seq(tok, model=None, label_pad_token_id=-100, pad_to_multiple_of=8)
    sampler = DistributedSampler(train, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(train, batch_size=args.micro_bsz, sampler=sampler, num_workers=2, drop_last=True,
                        collate_fn=lambda rows: collator(encode_rows(tok, rows, args.max_len)))

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if rank == 0:
        print(f"train={len(train)} world={world} updates/epoch={steps_per_epoch} new_id={new_id}", flush=True)

    best = -math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        run = torch.zeros(2, device=engine.device)
        for step, batch in enumerate(loader):
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            run += torch.stack([loss.detach().float(), torch.ones((), device=engine.device)])
            if (step + 1) % (50 * args.accum) == 0:
                dist.all_reduce(run)
                if rank == 0:
                    print(f"epoch {epoch} update {engine.global_steps} loss {(run[0] / run[1]).item():.4f}",
                          flush=True)
                run.zero_()

        scores = evaluate(engine, tok, dev, args, rank, world)
        avg = sum(scores.values()) / len(scores)
        if rank == 0:
            print(f"epoch {epoch} chrF++: {scores} avg {avg:.2f}", flush=True)
        engine.save_checkpoint(os.path.join(args.out, "ds"), tag=f"epoch{epoch}")
        if avg > best:
            best = avg
            engine.save_16bit_model(os.path.join(args.out, "best"))
            if rank == 0:
                engine.module.config.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
