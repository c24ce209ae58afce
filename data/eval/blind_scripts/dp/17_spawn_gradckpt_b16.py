"""CLIP ViT-B/16 with activation checkpointing, single node, launched with mp.spawn.

    python 17_spawn_gradckpt_b16.py --train-csv /data/cc12m/train.csv --val-csv /data/coco/karpathy_test.csv
"""
import argparse
import math
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip


class CsvPairs(Dataset):
    def __init__(self, path, transform, tokenizer, return_index=False):
        df = pd.read_csv(path)
        self.paths, self.caps = df["filepath"].tolist(), df["caption"].tolist()
        self.transform, self.tokenizer, self.return_index = transform, tokenizer, return_index

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.transform(Image.open(self.paths[i]).convert("RGB"))
        txt = self.tokenizer([str(self.caps[i])])[0]
        return (img, txt, i) if self.return_index else (img, txt)


class CkptCLIP(nn.Module):
    def __init__(self, embed_dim=512, grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.visual = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
        self.visual_proj = nn.Linear(768, embed_dim, bias=False)
        clip_text = open_clip.create_model("ViT-B-16")
        self.token_embedding = clip_text.token_embedding
        self.positional_embedding = clip_text.positional_embedding
        self.text_blocks = clip_text.transformer.resblocks
        self.ln_final = clip_text.ln_final
        self.text_projection = clip_text.text_projection
        self.register_buffer("attn_mask", clip_text.attn_mask.clone(), persistent=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        del clip_text

    def _run(self, block, x, **kw):
        if self.grad_ckpt and self.training:
            return checkpoint(block, x, use_reentrant=False, **kw)
        return block(x, **kw)

    def encode_image(self, x):
        v = self.visual
        x = v.norm_pre(v._pos_embed(v.patch_embed(x)))
        for blk in v.blocks:
            x = self._run(blk, x)
        x = v.norm(x)[:, 0]
        return F.normalize(self.visual_proj(x), dim=-1)

    def encode_text(self, text):
        x = self.token_embedding(text) + self.positional_embedding
        for blk in self.text_blocks:
            x = self._run(blk, x, attn_mask=self.attn_mask)
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection
        return F.normalize(x, dim=-1)

    def forward(self, image, text):
        return self.encode_image(image), self.encode_text(text), self.logit_scale.exp()


def clip_loss(img, txt, scale, rank, world):
    import torch.distributed.nn as dnn
    all_img = torch.cat(dnn.all_gather(img))
    all_txt = torch.cat(dnn.all_gather(txt))
    n = img.shape[0]
    labels = torch.arange(n, device=img.device) + rank * n
    return 0.5 * (F.cross_entropy(scale * img @ all_txt.t(), labels)
                  + F.cross_entropy(scale * txt @ all_img.t(), labels))


@torch.no_grad()
def coco_retrieval(model, loader, world, device, n_total):
    """Every rank encodes its (padded) slice; features are gathered and de-duplicated by index."""
    model.eval()
    imgs, txts, idxs = [], [], []
    for image, text, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            i, t, _ = model(image.to(device), text.to(device))
        imgs.append(i.float())
        txts.append(t.float())
        idxs.append(idx.to(device))
    imgs, txts, idxs = torch.cat(imgs), torch.cat(txts), torch.cat(idxs)
    out = {}
    for name, t in (("img", imgs), ("txt", txts), ("idx", idxs)):
        buf = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        out[name] = torch.cat(buf)
    order = torch.full((n_total,), -1, dtype=torch.long, device=device)
    order[out["idx"]] = torch.arange(out["idx"].numel(), device=device)
    img_f, txt_f = out["img"][order], out["txt"][order]
    sim = img_f @ txt_f.t()
    gt = torch.arange(n_total, device=device)
    model.train()
    return {"i2t_R@1": (sim.argmax(1) == gt).float().mean().item(),
            "t2i_R@1": (sim.t().argmax(1) == gt).float().mean().item()}


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://", rank=gpu, world_size=ngpus)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", gpu)

    model = CkptCLIP(grad_ckpt=not args.no_grad_ckpt).to(device)
    ddp = DDP(model, device_ids=[gpu])
    preprocess_train = open_clip.image_transform(224, is_train=True)
    preprocess_val = open_clip.image_transform(224, is_train=False)
    tokenizer = open_clip.get_tokenizer("ViT-B-16")

    train_set = CsvPairs(args.train_csv, preprocess_train, tokenizer)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_set = CsvPairs(args.val_csv, preprocess_val, tokenizer, return_index=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4)

    global_batch = args.batch_size * world
    lr = args.blr * global_batch / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd, betas=(0.9, 0.98), eps=1e-6)
    total = args.epochs * len(loader)
    warmup = min(args.warmup_steps, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"]
        del ck
    if rank == 0:
        print(f"world {world} global batch {global_batch} lr {lr:.2e} steps {total} (resume at epoch {start_epoch})")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        tic = time.time()
        for it, (images, texts) in enumerate(loader):
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = ddp(images, texts)
            loss = clip_loss(img.float(), txt.float(), scale, rank, world)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            if rank == 0 and it % 50 == 0:
                mem = torch.cuda.max_memory_allocated(device) / 2 ** 30
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                      f"{(time.time() - tic) / (it + 1):.3f}s/it mem {mem:.1f}G", flush=True)

        metrics = coco_retrieval(model, val_loader, world, device, len(val_set))
        if rank == 0:
            print(f"epoch {epoch} coco {metrics}", flush=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch + 1}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-csv", required=True)
    parser.add_argument("--val-csv", required=True)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=32)
    parser.add_argument("--blr", type=float, default=5e-4, help="lr for a global batch of 4096")
    parser.add_argument("--wd", type=float, default=0.2)
    parser.add_argument("--warmup-steps", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--no-grad-ckpt", action="store_true")
    parser.add_argument("--out", default="runs/b16_ckpt")
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    ngpus = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
