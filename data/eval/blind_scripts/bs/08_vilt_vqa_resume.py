"""ViLT VQAv2 fine-tuning, resumable (jobs get preempted on our cluster).

    torchrun --nproc_per_node=8 08_vilt_vqa_resume.py --data /data/vqav2 --ckpt-dir /shared/ckpt/vilt_vqa --resume
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import ViltConfig, ViltForQuestionAnswering, ViltProcessor, get_polynomial_decay_schedule_with_warmup

BASE = "dandelin/vilt-b32-mlm"


class VQAv2(Dataset):
    """Expects preprocessed jsonl with question, image path and label->score dict
    (labels are indices into the fixed 3129-answer vocab shipped with the data)."""

    def __init__(self, jsonl, image_root, num_labels):
        with open(jsonl) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_root = image_root
        self.num_labels = num_labels

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.image_root, r["image"])).convert("RGB")
        target = torch.zeros(self.num_labels)
        for lab, score in r["labels"].items():
            target[int(lab)] = score
        return img, r["question"], target


def get_collate(processor):
    def fn(batch):
        imgs, qs, targets = zip(*batch)
        enc = processor(images=list(imgs), text=list(qs), padding="max_length", truncation=True,
                        max_length=40, return_tensors="pt")
        enc["labels"] = torch.stack(targets)
        return enc
    return fn


def save_checkpoint(path, model, optimizer, scheduler, scaler, epoch, step, best):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "step": step,
        "best": best,
    }, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(**batch).logits
        pred = logits.argmax(-1, keepdim=True)
        acc[0] += labels.gather(1, pred).sum()
        acc[1] += labels.size(0)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--head-lr-mult", type=float, default=10.0)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "answer2label.json")) as f:
        label2answer = {v: k for k, v in json.load(f).items()}
    num_labels = len(label2answer)
    processor = ViltProcessor.from_pretrained(BASE)
    config = ViltConfig.from_pretrained(BASE, num_labels=num_labels,
                                        id2label=label2answer,
                                        label2id={a: i for i, a in label2answer.items()})
    model = ViltForQuestionAnswering.from_pretrained(BASE, config=config).to(device)

    train_ds = VQAv2(os.path.join(args.data, "train.jsonl"), os.path.join(args.data, "images"), num_labels)
    val_ds = VQAv2(os.path.join(args.data, "minival.jsonl"), os.path.join(args.data, "images"), num_labels)
    collate = get_collate(processor)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=collate)

    head = [p for n, p in model.named_parameters() if n.startswith("classifier")]
    body = [p for n, p in model.named_parameters() if not n.startswith("classifier")]
    optimizer = torch.optim.AdamW([{"params": body, "lr": args.lr},
                                   {"params": head, "lr": args.lr * args.head_lr_mult}],
                                  weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, int(0.1 * total), total, power=1.0)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, step, best = 0, 0, 0.0
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(last_path):
        state = torch.load(last_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, step, best = state["epoch"], state["step"], state["best"]
        del state
        if rank == 0:
            print(f"resumed at epoch {start_epoch} step {step} (best {best:.4f})")

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    steps_per_epoch = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = step - epoch * steps_per_epoch  # batches already done in this epoch before preemption
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            if i < skip:
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(**batch).logits
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels) * labels.shape[1]
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.3f} {time.time() - t0:.0f}s", flush=True)
            if step % args.save_every == 0:
                if rank == 0:
                    save_checkpoint(last_path, model, optimizer, scheduler, scaler, epoch, step, best)
                dist.barrier()

        acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} minival VQA score {acc:.4f}")
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best_model.pt"))
            save_checkpoint(last_path, model, optimizer, scheduler, scaler, epoch + 1, step, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
