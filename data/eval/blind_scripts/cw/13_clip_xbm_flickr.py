"""Fine-tune OpenCLIP on Flickr30k with a cross-batch memory of image and text embeddings.

    torchrun --nproc_per_node=4 13_clip_xbm_flickr.py --ann data/flickr30k --images /data/flickr30k-images \
        --out out/clip_xbm
"""
import argparse
import json
import logging
import os
import time

import open_clip
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
log = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann", required=True, help="folder with flickr30k_train.json / flickr30k_test.json")
    p.add_argument("--images", required=True)
    p.add_argument("--out", default="out/clip_xbm")
    p.add_argument("--arch", default="ViT-B-32")
    p.add_argument("--pretrained", default="laion2b_s34b_b79k")
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--memory", type=int, default=8192)
    p.add_argument("--memory-start", type=int, default=500, help="step at which memory negatives are used")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class PairData(Dataset):
    def __init__(self, rows, root, preprocess, tokenizer):
        self.rows, self.root, self.pre, self.tok = rows, root, preprocess, tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.pre(Image.open(os.path.join(self.root, r["image"])).convert("RGB"))
        return img, self.tok([r["caption"]])[0], r["image_id"]


class Images(Dataset):
    def __init__(self, paths, root, preprocess):
        self.paths, self.root, self.pre = paths, root, preprocess

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.pre(Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")), i


class Texts(Dataset):
    def __init__(self, caps, tokenizer):
        self.caps, self.tok = caps, tokenizer

    def __len__(self):
        return len(self.caps)

    def __getitem__(self, i):
        return self.tok([self.caps[i]])[0], i


class Memory:
    def __init__(self, size, dim, device):
        self.img = torch.zeros(size, dim, device=device)
        self.txt = torch.zeros(size, dim, device=device)
        self.ids = torch.full((size,), -1, dtype=torch.long, device=device)
        self.size, self.ptr, self.n = size, 0, 0

    @torch.no_grad()
    def add(self, img, txt, ids):
        k = img.shape[0]
        slot = (self.ptr + torch.arange(k, device=img.device)) % self.size
        self.img[slot], self.txt[slot], self.ids[slot] = img, txt, ids
        self.ptr, self.n = (self.ptr + k) % self.size, min(self.size, self.n + k)


@torch.no_grad()
def gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def xbm_clip_loss(img, txt, ids, scale, mem, use_mem):
    rank, n = dist.get_rank(), img.shape[0]
    all_img, all_txt, all_ids = gather(img.detach()), gather(txt.detach()), gather(ids)
    all_img[rank * n:(rank + 1) * n] = img
    all_txt[rank * n:(rank + 1) * n] = txt
    tgt = torch.arange(n, device=img.device) + rank * n
    i2t = scale * img @ all_txt.T
    t2i = scale * txt @ all_img.T
    # other captions of the same image are not negatives
    dup = ids[:, None] == all_ids[None, :]
    dup[torch.arange(n), tgt] = False
    i2t, t2i = i2t.masked_fill(dup, -1e4), t2i.masked_fill(dup, -1e4)
    if use_mem and mem.n > 0:
        m_valid = mem.ids[:mem.n]
        m_mask = ids[:, None] == m_valid[None, :]
        i2t = torch.cat([i2t, (scale * img @ mem.txt[:mem.n].T).masked_fill(m_mask, -1e4)], 1)
        t2i = torch.cat([t2i, (scale * txt @ mem.img[:mem.n].T).masked_fill(m_mask, -1e4)], 1)
    loss = 0.5 * (F.cross_entropy(i2t, tgt) + F.cross_entropy(t2i, tgt))
    return loss, all_img.detach(), all_txt.detach(), all_ids


@torch.no_grad()
def embed(fn, ds, n_dim, batch, workers):
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers)
    feats, idx = [], []
    for x, i in loader:
        feats.append(F.normalize(fn(x.to(DEVICE, non_blocking=True)).float(), dim=-1))
        idx.append(i.to(DEVICE))
    feats, idx = gather(torch.cat(feats)), gather(torch.cat(idx))
    out = torch.zeros(len(ds), n_dim, device=DEVICE)
    out[idx] = feats
    return out


@torch.no_grad()
def evaluate(clip, test_rows, root, preprocess, tokenizer, workers, ks=(1, 5, 10)):
    clip.eval()
    paths = [r["image"] for r in test_rows]
    caps, cap2img = [], []
    for j, r in enumerate(test_rows):
        for c in r["captions"]:
            caps.append(c)
            cap2img.append(j)
    dim = clip.text_projection.shape[1]
    img = embed(clip.encode_image, Images(paths, root, preprocess), dim, 256, workers)
    txt = embed(clip.encode_text, Texts(caps, tokenizer), dim, 512, workers)
    cap2img = torch.tensor(cap2img, device=DEVICE)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, len(caps), world, device=DEVICE)
    top = (txt[mine] @ img.T).topk(max(ks), dim=1).indices
    hit = top == cap2img[mine, None]
    counts = torch.stack([hit[:, :k].any(1).sum() for k in ks] + [mine.new_tensor(len(mine))]).double()
    dist.all_reduce(counts)
    clip.train()
    return {f"t2i_R@{k}": (100 * counts[j] / counts[-1]).item() for j, k in enumerate(ks)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    clip, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.arch,
                                                                                   pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.arch)
    clip = clip.to(DEVICE)
    model = DDP(clip, device_ids=[local_rank])

    with open(os.path.join(args.ann, "flickr30k_train.json")) as f:
        train_rows = json.load(f)
    with open(os.path.join(args.ann, "flickr30k_test.json")) as f:
        test_rows = json.load(f)
    train_ds = PairData(train_rows, args.images, preprocess_train, tokenizer)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * world * args.batch_size / 512
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    scaler = torch.cuda.amp.GradScaler()
    mem = Memory(args.memory, clip.text_projection.shape[1], DEVICE)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for img, tok, ids in loader:
            img, tok, ids = img.to(DEVICE, non_blocking=True), tok.to(DEVICE), ids.to(DEVICE)
            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, scale = model(img, tok)
            loss, g_img, g_txt, g_ids = xbm_clip_loss(img_f.float(), txt_f.float(), ids, scale.float(), mem,
                                                       step >= args.memory_start)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():
                clip.logit_scale.clamp_(0, 4.6052)
            mem.add(g_img, g_txt, g_ids)
            step += 1
            if step % 50 == 0:
                log.info("epoch %d step %d loss %.4f scale %.2f", epoch, step, loss.item(), scale.item())

        res = evaluate(clip, test_rows, args.images, preprocess_val, tokenizer, args.workers)
        log.info("epoch %d done in %.0fs %s", epoch, time.time() - t0, res)
        if rank == 0 and res["t2i_R@1"] > best:
            best = res["t2i_R@1"]
            torch.save({"state_dict": clip.state_dict(), "epoch": epoch, "metrics": res},
                       os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
