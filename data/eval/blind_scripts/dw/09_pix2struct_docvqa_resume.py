"""Pix2Struct-base fine-tuning on internal document QA (statements, policy schedules).

Long job (~3 days on 8xA100), preemptible queue, so it checkpoints every N steps and
resumes from the newest checkpoint in --run_dir.

    torchrun --nproc_per_node=8 09_pix2struct_docvqa_resume.py --run_dir /shared/runs/p2s_docqa --resume auto
"""
import argparse
import glob
import json
import logging
import os
import re

import Levenshtein
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import Pix2StructForConditionalGeneration, Pix2StructProcessor
from transformers.optimization import Adafactor, get_cosine_schedule_with_warmup

logger = logging.getLogger("p2s")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_jsonl", default="/shared/docqa/train.jsonl")
    ap.add_argument("--val_jsonl", default="/shared/docqa/val.jsonl")
    ap.add_argument("--image_root", default="/shared/docqa/pages")
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--resume", default=None, help="checkpoint path or 'auto'")
    ap.add_argument("--base", default="google/pix2struct-docvqa-base")
    ap.add_argument("--max_patches", type=int, default=2048)
    ap.add_argument("--max_answer_len", type=int, default=48)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--total_steps", type=int, default=60000)
    ap.add_argument("--warmup_steps", type=int, default=1000)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--eval_every", type=int, default=5000)
    return ap.parse_args()


class DocQA(Dataset):
    def __init__(self, path, image_root):
        with open(path) as fh:
            self.rows = [json.loads(l) for l in fh]
        self.image_root = image_root

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return Image.open(os.path.join(self.image_root, r["image"])).convert("RGB"), r["question"], r["answers"]


class Collator:
    def __init__(self, processor, max_patches, max_answer_len):
        self.processor = processor
        self.max_patches = max_patches
        self.max_answer_len = max_answer_len

    def __call__(self, batch):
        images, questions, answers = zip(*batch)
        enc = self.processor(images=list(images), text=list(questions), max_patches=self.max_patches,
                             return_tensors="pt")
        tgt = self.processor.tokenizer([a[0] for a in answers], padding="longest", truncation=True,
                                       max_length=self.max_answer_len, return_tensors="pt").input_ids
        tgt[tgt == self.processor.tokenizer.pad_token_id] = -100
        enc["labels"] = tgt
        enc["answers"] = list(answers)
        return enc


def anls_score(pred, golds, thr=0.5):
    p = pred.strip().lower()
    scores = []
    for g in golds:
        g = g.strip().lower()
        d = Levenshtein.distance(p, g) / max(len(p), len(g), 1)
        scores.append(1.0 - d if d < thr else 0.0)
    return max(scores) if scores else 0.0


def latest_checkpoint(run_dir):
    ckpts = glob.glob(os.path.join(run_dir, "ckpt_*.pt"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(re.search(r"ckpt_(\d+)\.pt", p).group(1)))


@torch.no_grad()
def run_eval(model, loader, processor, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        gen = model.generate(flattened_patches=batch["flattened_patches"].to(device),
                             attention_mask=batch["attention_mask"].to(device), max_new_tokens=48)
        for pred, golds in zip(processor.batch_decode(gen, skip_special_tokens=True), batch["answers"]):
            acc[0] += anls_score(pred, golds)
            acc[1] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s r{rank} %(message)s")

    processor = Pix2StructProcessor.from_pretrained(args.base)
    model = Pix2StructForConditionalGeneration.from_pretrained(args.base).to(device)
    optimizer = Adafactor(model.parameters(), lr=args.lr, scale_parameter=False, relative_step=False,
                          warmup_init=False, weight_decay=1e-5)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.total_steps)

    step = 0
    ckpt_path = latest_checkpoint(args.run_dir) if args.resume == "auto" else args.resume
    if ckpt_path:
        state = torch.load(ckpt_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
        del state
        logger.info("resumed %s (step %d)", ckpt_path, step)

    model = DDP(model, device_ids=[local_rank])

    collate = Collator(processor, args.max_patches, args.max_answer_len)
    train_ds = DocQA(args.train_jsonl, args.image_root)
    val_ds = DocQA(args.val_jsonl, args.image_root)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=11)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=8,
                        collate_fn=collate, num_workers=4)

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    epoch, skip = divmod(step, len(train_dl))
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(train_dl):
            if skip and i < skip:
                continue
            skip = 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(flattened_patches=batch["flattened_patches"].to(device, non_blocking=True),
                             attention_mask=batch["attention_mask"].to(device, non_blocking=True),
                             labels=batch["labels"].to(device, non_blocking=True)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 100 == 0:
                logger.info("step %d epoch %d loss %.4f lr %.2e", step, epoch, loss.item(), scheduler.get_last_lr()[0])
            if step % args.save_every == 0:
                if rank == 0:
                    tmp = os.path.join(args.run_dir, f"ckpt_{step}.pt.tmp")
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch}, tmp)
                    os.replace(tmp, tmp[:-4])
                dist.barrier()
            if step % args.eval_every == 0:
                score = run_eval(model.module, val_dl, processor, device)
                logger.info("step %d val ANLS %.4f", step, score)
            if step >= args.total_steps:
                break
        epoch += 1

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.run_dir, "final"))
        processor.save_pretrained(os.path.join(args.run_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
