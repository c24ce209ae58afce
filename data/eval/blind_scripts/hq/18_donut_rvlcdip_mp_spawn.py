"""Donut document classification on RVL-CDIP, one process per GPU started with mp.spawn
(our cluster wrapper only runs `python script.py`, no torchrun).

    python 18_donut_rvlcdip_mp_spawn.py --root /datasets/rvl-cdip --gpus 8
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

CLASSES = ["letter", "form", "email", "handwritten", "advertisement", "scientific_report",
           "scientific_publication", "specification", "file_folder", "news_article", "budget",
           "invoice", "presentation", "questionnaire", "resume", "memo"]
TASK = "<s_rvlcdip>"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--pretrained", default="naver-clova-ix/donut-base")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--height", type=int, default=1280)
    ap.add_argument("--width", type=int, default=960)
    ap.add_argument("--out", default="runs/donut_rvlcdip")
    ap.add_argument("--resume", default="")
    ap.add_argument("--val_limit", type=int, default=8000)
    return ap.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RVLDonut(Dataset):
    def __init__(self, root, split, processor, limit=None):
        with open(os.path.join(root, "labels", f"{split}.txt")) as f:
            self.items = [(p, int(y)) for p, y in (l.split() for l in f if l.strip())]
        if limit:
            self.items = self.items[:limit]
        self.root, self.processor = root, processor

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        img = Image.open(os.path.join(self.root, "images", path)).convert("RGB")
        pixel_values = self.processor(img, return_tensors="pt").pixel_values[0]
        target = f"{TASK}<s_class><{CLASSES[y]}/></s_class></s>"
        ids = self.processor.tokenizer(target, add_special_tokens=False, return_tensors="pt").input_ids[0]
        return pixel_values, ids, y


def collate(batch, pad_id):
    pixel_values = torch.stack([b[0] for b in batch])
    ids = torch.nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=pad_id)
    labels = ids.clone()
    labels[labels == pad_id] = -100
    return pixel_values, ids, labels, torch.tensor([b[2] for b in batch])


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


@torch.no_grad()
def evaluate(model, loader, processor, device):
    model.eval()
    tok = processor.tokenizer
    class_token_ids = tok.convert_tokens_to_ids([f"<{c}/>" for c in CLASSES])
    hits = torch.zeros(2, device=device)
    for pixel_values, _, _, y in loader:
        pixel_values = pixel_values.to(device)
        prompt = torch.tensor([tok.convert_tokens_to_ids([TASK, "<s_class>"])], device=device)
        prompt = prompt.expand(pixel_values.size(0), -1)
        # unwrap DDP for generation: generate() lives on the HF model, and no gradients are synced here
        out = model.module.generate(pixel_values, decoder_input_ids=prompt, max_new_tokens=3,
                                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        pred_tok = out[:, prompt.size(1)].tolist()
        pred = torch.tensor([class_token_ids.index(t) if t in class_token_ids else -1 for t in pred_tok])
        hits[0] += (pred == y).sum().to(device)
        hits[1] += y.numel()
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(1234)

    processor = DonutProcessor.from_pretrained(args.pretrained)
    processor.image_processor.size = {"height": args.height, "width": args.width}
    processor.tokenizer.add_special_tokens(
        {"additional_special_tokens": [TASK, "<s_class>", "</s_class>"] + [f"<{c}/>" for c in CLASSES]}
    )
    model = VisionEncoderDecoderModel.from_pretrained(args.pretrained)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK)
    model.config.encoder.image_size = [args.height, args.width]

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model.to(device), device_ids=[rank])

    train_ds = RVLDonut(args.root, "train", processor)
    val_ds = RVLDonut(args.root, "val", processor, limit=args.val_limit)
    collate_fn = Collate(processor.tokenizer.pad_token_id)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    # cut val to a multiple of the GPU count, so the sampler adds no repeated pages
    val_ds.items = val_ds.items[: len(val_ds.items) - len(val_ds.items) % world_size]
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          collate_fn=collate_fn, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=16, sampler=val_sampler, num_workers=4, collate_fn=collate_fn)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, min(1000, total // 20), total)
    if args.resume:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        del ckpt

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (pixel_values, ids, labels, _) in enumerate(train_dl):
            pixel_values, ids, labels = pixel_values.to(device), ids.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=pixel_values, decoder_input_ids=ids[:, :-1], labels=labels[:, 1:]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} {time.time() - t0:.0f}s",
                      flush=True)

        acc = evaluate(model, val_dl, processor, device)
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
            processor.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
