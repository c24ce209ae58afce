"""Fine-tune BLIP (captioning head) on chest X-ray reports with gradient accumulation,
beam-search validation, CheXbert F1 model selection and early stopping.

    torchrun --nproc_per_node=4 15_blip_accum_earlystop.py --accum 4 --out runs/blip_cxr
    torchrun --nproc_per_node=4 15_blip_accum_earlystop.py --resume runs/blip_cxr/last.pt
"""
import argparse
import contextlib
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from f1chexbert import F1CheXbert
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import BlipForConditionalGeneration, BlipProcessor, get_cosine_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", default="data/cxr/train.csv")
    p.add_argument("--val-csv", default="data/cxr/val.csv")
    p.add_argument("--image-dir", default="data/cxr/images")
    p.add_argument("--blip", default="Salesforce/blip-image-captioning-base")
    p.add_argument("--out", default="runs/blip_cxr")
    p.add_argument("--resume", default="")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5, help="lr for global batch 128; scaled linearly")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--beams", type=int, default=3)
    return p.parse_args()


class CXRCaptions(Dataset):
    def __init__(self, csv, image_dir, processor, max_len):
        self.df = pd.read_csv(csv)
        self.image_dir, self.proc, self.max_len = image_dir, processor, max_len

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = Image.open(os.path.join(self.image_dir, row.image)).convert("RGB")
        enc = self.proc(images=img, text=row.report, padding="max_length", truncation=True,
                        max_length=self.max_len, return_tensors="pt")
        return {"pixel_values": enc.pixel_values[0], "input_ids": enc.input_ids[0],
                "attention_mask": enc.attention_mask[0], "index": i}


def strip_prefix(sd, prefix="module."):
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    processor = BlipProcessor.from_pretrained(args.blip)
    train_ds = CXRCaptions(args.train_csv, args.image_dir, processor, args.max_len)
    val_ds = CXRCaptions(args.val_csv, args.image_dir, processor, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_batch * 2, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=8, pin_memory=True)

    model = BlipForConditionalGeneration.from_pretrained(args.blip)
    start_epoch, best_f1, bad_epochs = 0, -1.0, 0
    ckpt = None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(strip_prefix(ckpt["model"]))
        start_epoch, best_f1, bad_epochs = ckpt["epoch"] + 1, ckpt["best_f1"], ckpt["bad_epochs"]
    model = DDP(model.to(device), device_ids=[local_rank])

    global_batch = args.micro_batch * args.accum * world
    lr = args.lr * global_batch / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    updates_per_epoch = len(train_dl) // args.accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, updates_per_epoch // 2, updates_per_epoch * args.epochs)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        del ckpt

    writer, scorer = None, None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        scorer = F1CheXbert(device=device)
        print(f"world {world}, global batch {global_batch}, lr {lr:.2e}, {updates_per_epoch} updates/epoch")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t0 = time.time()
        n_micro = updates_per_epoch * args.accum
        for i, batch in enumerate(train_dl):
            if i >= n_micro:
                break
            last_micro = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(pixel_values=batch["pixel_values"].to(device, non_blocking=True),
                            input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
                (out.loss / args.accum).backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                update = epoch * updates_per_epoch + (i + 1) // args.accum
                if writer is not None and update % 25 == 0:
                    writer.add_scalar("train/loss", out.loss.item(), update)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], update)

        model.eval()
        local = []
        for batch in val_dl:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                gen = model.module.generate(pixel_values=batch["pixel_values"].to(device),
                                            num_beams=args.beams, max_length=args.max_len)
            texts = processor.batch_decode(gen, skip_special_tokens=True)
            local.extend(zip(batch["index"].tolist(), texts))
        shards = [None] * world
        dist.all_gather_object(shards, local)

        stop = [False]
        if rank == 0:
            hyp = {}
            for shard in shards:
                hyp.update(shard)                    # padded duplicates collapse onto the same index
            keys = sorted(hyp)
            refs = val_ds.df.report.iloc[keys].tolist()
            _, _, r14, r5 = scorer(hyps=[hyp[k] for k in keys], refs=refs)
            f1 = r14["micro avg"]["f1-score"]
            writer.add_scalar("val/ce_micro_f1_14", f1, epoch)
            writer.add_scalar("val/ce_micro_f1_5", r5["micro avg"]["f1-score"], epoch)
            print(f"epoch {epoch}: micro-F1 {f1:.4f} over {len(keys)} studies ({time.time() - t0:.0f}s)", flush=True)
            if f1 > best_f1:
                best_f1, bad_epochs = f1, 0
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
            else:
                bad_epochs += 1
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_f1": best_f1,
                        "bad_epochs": bad_epochs}, os.path.join(args.out, "last.pt"))
            stop[0] = bad_epochs >= args.patience
        dist.broadcast_object_list(stop, src=0)
        if stop[0]:
            if rank == 0:
                print(f"early stopping after epoch {epoch}, best micro-F1 {best_f1:.4f}")
            break

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
