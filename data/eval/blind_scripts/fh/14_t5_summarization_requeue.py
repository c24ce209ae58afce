#!/usr/bin/env python
"""Fine-tune flan-t5-large for abstractive summarisation of clinical notes.

Slurm (preemptible QOS, job is requeued with --requeue and resumes from the
last checkpoint on the project file system):

    #SBATCH --qos=preemptible --requeue
    #SBATCH --nodes=2 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=8
    #SBATCH --time=08:00:00

    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    export MASTER_PORT=25678
    export HF_HOME=/proj/clinical/hf_cache HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    srun python t5_summ.py --train /proj/clinical/notes/train.jsonl \
        --valid /proj/clinical/notes/valid.jsonl --out /proj/clinical/runs/flan_t5_large
"""
import argparse
import json
import os
import time

import evaluate
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_cosine_schedule_with_warmup


class NotesDataset(Dataset):
    def __init__(self, path, tok, max_src=1024, max_tgt=256):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.tok, self.max_src, self.max_tgt = tok, max_src, max_tgt

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def collate(self, rows):
        enc = self.tok(["summarize: " + r["note"] for r in rows], max_length=self.max_src,
                       truncation=True, padding=True, return_tensors="pt")
        lab = self.tok(text_target=[r["summary"] for r in rows], max_length=self.max_tgt,
                       truncation=True, padding=True, return_tensors="pt")["input_ids"]
        lab[lab == self.tok.pad_token_id] = -100
        enc["labels"] = lab
        enc["ref"] = [r["summary"] for r in rows]
        return enc


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/flan-t5-large")
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--save-steps", type=int, default=500)
    return ap.parse_args()


def save(path, model, opt, sched, epoch, step):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)


def main():
    args = parse()
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    dev = torch.device("cuda", local)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = NotesDataset(args.train, tok)
    valid_ds = NotesDataset(args.valid, tok)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, args.bs, sampler=tr_sampler, collate_fn=train_ds.collate,
                          num_workers=4, drop_last=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), 16,
                          collate_fn=valid_ds.collate, num_workers=2)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 8, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    ckpt = os.path.join(args.out, "resume.pt")
    epoch0, step = 0, 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        epoch0, step = state["epoch"], state["step"]
        if rank == 0:
            print(f"resuming: epoch {epoch0}, step {step}", flush=True)
    elif rank == 0:
        os.makedirs(args.out, exist_ok=True)

    rouge = evaluate.load("rouge")
    for epoch in range(epoch0, args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        skip = step - epoch * len(train_dl)
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            if i < skip:
                continue
            batch.pop("ref")
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_steps == 0:
                if rank == 0:
                    save(ckpt, model, opt, sched, epoch, step)
                dist.barrier()

        # generation-based validation, gathered on rank 0 for ROUGE
        model.eval()
        preds, refs = [], []
        with torch.no_grad():
            for batch in valid_dl:
                refs.extend(batch.pop("ref"))
                out = model.module.generate(input_ids=batch["input_ids"].to(dev),
                                            attention_mask=batch["attention_mask"].to(dev),
                                            max_new_tokens=256, num_beams=4)
                preds.extend(tok.batch_decode(out, skip_special_tokens=True))
        gathered = [None] * world
        dist.all_gather_object(gathered, (preds, refs))
        if rank == 0:
            all_p = [p for g in gathered for p in g[0]]
            all_r = [r for g in gathered for r in g[1]]
            scores = rouge.compute(predictions=all_p, references=all_r)
            print(f"epoch {epoch} ROUGE-L {scores['rougeL']:.4f} ROUGE-1 {scores['rouge1']:.4f}",
                  flush=True)
            save(ckpt, model, opt, sched, epoch + 1, step)
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
