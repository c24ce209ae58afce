"""ViT-B/32 (quickgelu) CLIP on CC3M, Flickr30k retrieval as the dev metric.

Launch on one node:
    torchrun --standalone --nproc_per_node=8 15_b32_cc3m_timm_sched.py --train-csv /data/cc3m/cc3m_train.tsv \
        --flickr-root /data/flickr30k
"""
import argparse
import json
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip


class PairCsv(Dataset):
    def __init__(self, path, transform, tokenizer):
        df = pd.read_csv(path, sep="\t")
        self.files, self.texts = df["filepath"].tolist(), df["title"].tolist()
        self.transform, self.tokenizer = transform, tokenizer

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.transform(Image.open(self.files[i]).convert("RGB")), self.tokenizer([str(self.texts[i])])[0]


class Flickr30kTest(Dataset):
    """Karpathy test split: 1000 images, 5 captions each."""

    def __init__(self, root, transform):
        with open(os.path.join(root, "karpathy_test.json")) as f:
            self.items = json.load(f)
        self.root, self.transform = root, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.transform(Image.open(os.path.join(self.root, "images", self.items[i]["image"])).convert("RGB"))


@torch.no_grad()
def flickr_retrieval(model, tokenizer, ds, device):
    model.eval()
    loader = DataLoader(ds, batch_size=128, num_workers=4)
    img_emb = torch.cat([model.encode_image(x.to(device), normalize=True) for x in loader])
    captions, owner = [], []
    for idx, item in enumerate(ds.items):
        for c in item["captions"][:5]:
            captions.append(c)
            owner.append(idx)
    owner = torch.tensor(owner, device=device)
    txt_emb = torch.cat([model.encode_text(tokenizer(captions[i:i + 512]).to(device), normalize=True)
                         for i in range(0, len(captions), 512)])
    sim = img_emb @ txt_emb.T
    i2t_r1 = (owner[sim.argmax(1)] == torch.arange(len(img_emb), device=device)).float().mean().item()
    t2i_r1 = (sim.T.argmax(1) == owner).float().mean().item()
    model.train()
    return {"i2t_R@1": i2t_r1, "t2i_R@1": t2i_r1}


def gather_cat(x, rank, world):
    buf = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(buf, x)
    buf[rank] = x
    return torch.cat(buf)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--flickr-root", default=None)
    p.add_argument("--model", default="ViT-B-32-quickgelu")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="outputs/b32_cc3m")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model, tf_train, tf_val = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)
    ddp_model = DDP(model, device_ids=[local_rank])

    train_set = PairCsv(args.train_csv, tf_train, tokenizer)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    flickr = Flickr30kTest(args.flickr_root, tf_val) if (args.flickr_root and rank == 0) else None

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    steps_per_epoch = len(train_set) // args.batch_size
    scheduler = CosineLRScheduler(
        optimizer,
        t_initial=args.epochs * steps_per_epoch,
        lr_min=args.min_lr,
        warmup_t=int(args.warmup_epochs * steps_per_epoch),
        warmup_lr_init=1e-6,
        t_in_epochs=False,
    )
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} pairs | world {world} | loader len {len(loader)}", flush=True)

    num_updates = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for it, (images, texts) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img, txt, scale = ddp_model(images, texts)
                all_img, all_txt = gather_cat(img, rank, world), gather_cat(txt, rank, world)
                li = scale * img @ all_txt.T
                lt = scale * txt @ all_img.T
                y = torch.arange(img.shape[0], device=device) + rank * img.shape[0]
                loss = 0.5 * (F.cross_entropy(li, y) + F.cross_entropy(lt, y))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            num_updates += 1
            scheduler.step_update(num_updates)
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} {it}/{len(loader)} loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.2e}"
                      f" {(it + 1) * args.batch_size * world / (time.time() - t0):.0f} img/s", flush=True)

        dist.all_reduce(loss_sum)
        if rank == 0:
            rec = {"epoch": epoch, "train_loss": (loss_sum[0] / loss_sum[1]).item()}
            if flickr is not None:
                rec.update(flickr_retrieval(model, tokenizer, flickr, device))
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "num_updates": num_updates}, os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
