"""Abstractive summarization of call transcripts (flan-t5-large) on SageMaker.

Input data and checkpoints live on FSx for Lustre, attached as a read-write channel:

    fsx = FileSystemInput(file_system_id="fs-0a1b2c3d4e5f", file_system_type="FSxLustre",
                          directory_path="/abcdefgh/summ", file_system_access_mode="rw")
    est = PyTorch(entry_point="train_summ.py", instance_type="ml.p4d.24xlarge", instance_count=2,
                  framework_version="2.1", py_version="py310",
                  distribution={"torch_distributed": {"enabled": True}},
                  subnets=[...], security_group_ids=[...],
                  hyperparameters={"run-name": "t5l-calls-v4", "epochs": 6})
    est.fit({"fsx": fsx})
"""
import argparse
import json
import logging
import os
import time

import evaluate as hf_evaluate
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
logger = logging.getLogger("summ")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--fsx", default=os.environ.get("SM_CHANNEL_FSX", "/opt/ml/input/data/fsx"))
    ap.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "/opt/ml/model"))
    ap.add_argument("--base", default="google/flan-t5-large")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--src-len", type=int, default=1024)
    ap.add_argument("--tgt-len", type=int, default=160)
    return ap.parse_args()


class CallSummaries(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return "summarize: " + r["transcript"], r["summary"]


class Seq2SeqCollator:
    def __init__(self, tok, src_len, tgt_len):
        self.tok, self.src_len, self.tgt_len = tok, src_len, tgt_len

    def __call__(self, batch):
        src, tgt = zip(*batch)
        enc = self.tok(list(src), max_length=self.src_len, truncation=True, padding=True, return_tensors="pt")
        lab = self.tok(text_target=list(tgt), max_length=self.tgt_len, truncation=True, padding=True,
                       return_tensors="pt")["input_ids"]
        lab[lab == self.tok.pad_token_id] = -100
        enc["labels"] = lab
        enc["refs"] = list(tgt)
        return enc


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_rouge):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "best_rouge": best_rouge}, path)


@torch.no_grad()
def rouge_eval(model, loader, tok, device, world, max_new_tokens):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        out = model.module.generate(input_ids=batch["input_ids"].to(device),
                                    attention_mask=batch["attention_mask"].to(device),
                                    max_new_tokens=max_new_tokens, num_beams=4)
        preds += tok.batch_decode(out, skip_special_tokens=True)
        refs += batch["refs"]
    everything = [None] * world
    dist.all_gather_object(everything, (preds, refs))
    model.train()
    all_preds = [p for part in everything for p in part[0]]
    all_refs = [r for part in everything for r in part[1]]
    scores = hf_evaluate.load("rouge").compute(predictions=all_preds, references=all_refs)
    return scores["rougeL"]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)

    data_dir = os.path.join(args.fsx, "data")
    ckpt_path = os.path.join(args.fsx, "checkpoints", args.run_name, "last.pt")

    tok = AutoTokenizer.from_pretrained(args.base)
    collate = Seq2SeqCollator(tok, args.src_len, args.tgt_len)
    train_ds = CallSummaries(os.path.join(data_dir, "train.jsonl"))
    val_ds = CallSummaries(os.path.join(data_dir, "val.jsonl"))
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=16,
                        collate_fn=collate, num_workers=2)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.base).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)

    start_epoch, best_rouge = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best_rouge = ck["epoch"] + 1, ck["best_rouge"]
        logger.info("resuming from %s (epoch %d)", ckpt_path, start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        model.train()
        for step, batch in enumerate(train_dl):
            inputs = {k: batch[k].to(device, non_blocking=True) for k in ("input_ids", "attention_mask", "labels")}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        rouge_l = rouge_eval(model, val_dl, tok, device, world, args.tgt_len)
        logger.info("epoch %d rougeL %.4f (%.0fs)", epoch, rouge_l, time.time() - tic)
        best_rouge = max(best_rouge, rouge_l)
        save_checkpoint(ckpt_path, model, optimizer, scheduler, epoch, best_rouge)
        if rank == 0 and rouge_l >= best_rouge:
            model.module.save_pretrained(args.model_dir)
            tok.save_pretrained(args.model_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
