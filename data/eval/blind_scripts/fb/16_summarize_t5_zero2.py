"""Fine-tune Flan-T5-XL for abstractive summarization of support tickets (DeepSpeed ZeRO-2, bf16).

torchrun --nproc_per_node 8 summarize_t5_zero2.py --train data/tickets/train.jsonl \
    --dev data/tickets/dev.jsonl --out ckpt/t5xl-tickets
"""
import argparse
import json
import os

import deepspeed
import evaluate
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/flan-t5-xl")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--src_len", type=int, default=1024)
    ap.add_argument("--tgt_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args()


class Tickets(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return i, "summarize: " + r["thread"], r["summary"]


class Seq2SeqCollator:
    def __init__(self, tok, src_len, tgt_len):
        self.tok, self.src_len, self.tgt_len = tok, src_len, tgt_len

    def __call__(self, batch):
        idx, src, tgt = zip(*batch)
        enc = self.tok(list(src), max_length=self.src_len, truncation=True, padding=True, return_tensors="pt")
        lab = self.tok(text_target=list(tgt), max_length=self.tgt_len, truncation=True, padding=True,
                       return_tensors="pt")["input_ids"]
        lab[lab == self.tok.pad_token_id] = -100
        enc["labels"] = lab
        enc["refs"] = list(tgt)
        enc["idx"] = list(idx)
        return enc


def run_dev(engine, loader, tok, device, max_new):
    """ROUGE on the dev set; every rank decodes its shard, results are gathered to rank 0."""
    engine.eval()
    results = {}
    with torch.no_grad():
        for batch in loader:
            gen = engine.module.generate(input_ids=batch["input_ids"].to(device),
                                         attention_mask=batch["attention_mask"].to(device),
                                         max_new_tokens=max_new, num_beams=4)
            for i, p, r in zip(batch["idx"], tok.batch_decode(gen, skip_special_tokens=True), batch["refs"]):
                results[i] = (p, r)
    engine.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for part in gathered:
        merged.update(part)  # the sampler pads with repeats; keyed by index they count once
    all_p = [merged[i][0] for i in sorted(merged)]
    all_r = [merged[i][1] for i in sorted(merged)]
    return evaluate.load("rouge").compute(predictions=all_p, references=all_r)


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)

    collator = Seq2SeqCollator(tok, args.src_len, args.tgt_len)
    train_ds, dev_ds = Tickets(args.train), Tickets(args.dev)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collator,
                          num_workers=4)
    dev_dl = DataLoader(dev_ds, batch_size=args.batch_size * 2, collate_fn=collator,
                        sampler=DistributedSampler(dev_ds, num_replicas=world, rank=rank, shuffle=False))

    steps_per_epoch = len(train_dl) // args.accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": args.accum,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": steps_per_epoch // 10,
                                 "total_num_steps": steps_per_epoch * args.epochs}},
        "gradient_clipping": 1.0,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    best_rouge = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_dl:
            loss = engine(input_ids=batch["input_ids"].to(device),
                          attention_mask=batch["attention_mask"].to(device),
                          labels=batch["labels"].to(device)).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 50 == 0 and rank == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {loss.item():.4f}", flush=True)

        scores = run_dev(engine, dev_dl, tok, device, args.tgt_len)
        if rank == 0:
            print(f"epoch {epoch} dev: " + ", ".join(f"{k}={v:.4f}" for k, v in scores.items()), flush=True)
        is_best = torch.tensor([1 if rank == 0 and scores["rougeL"] > best_rouge else 0], device=device)
        dist.broadcast(is_best, src=0)
        if rank == 0 and is_best.item():
            best_rouge = scores["rougeL"]
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}")
        if is_best.item():
            engine.save_16bit_model(os.path.join(args.out, "best"))
            if rank == 0:
                tok.save_pretrained(os.path.join(args.out, "best"))
                engine.module.config.save_pretrained(os.path.join(args.out, "best"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
