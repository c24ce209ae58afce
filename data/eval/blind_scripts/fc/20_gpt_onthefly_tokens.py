"""Class-conditional transformer prior trained directly on images: the frozen VQGAN (taming f16, 1024 codes)
tokenizes every batch on the fly, so no token cache is needed when we switch augmentation.

    torchrun --nproc_per_node=8 20_gpt_onthefly_tokens.py --data /datasets/imagenet/train \
        --vqgan_cfg taming/configs/vqgan_imagenet_f16_1024.yaml --vqgan_ckpt ckpt/vqgan_imagenet_f16_1024.ckpt \
        --out runs/gpt_otf
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from taming.models.vqgan import VQModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def load_vqgan(cfg_path, ckpt_path):
    cfg = OmegaConf.load(cfg_path)
    model = VQModel(**cfg.model.params)
    sd = torch.load(ckpt_path, map_location="cpu")["state_dict"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [k for k in missing if not k.startswith("loss.")], missing
    return model.eval().requires_grad_(False)


@torch.no_grad()
def encode(vqgan, x):
    _, _, (_, _, idx) = vqgan.encode(x)
    return idx.view(x.shape[0], -1)


@torch.no_grad()
def decode(vqgan, idx, grid=16):
    zq = vqgan.quantize.get_codebook_entry(idx.reshape(-1), shape=(idx.shape[0], grid, grid, 256))
    return vqgan.decode(zq)


class GPT(nn.Module):
    def __init__(self, vocab=1024, n_cls=1000, seq=256, d=1024, L=24, H=16, p=0.1):
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, d)
        self.cls = nn.Embedding(n_cls, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.drop = nn.Dropout(p)
        layer = nn.TransformerEncoderLayer(d, H, 4 * d, p, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, L)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx, y):
        x = torch.cat([self.cls(y)[:, None], self.tok(idx[:, :-1])], 1)
        t = x.shape[1]
        x = self.drop(x + self.pos[:, :t])
        x = self.blocks(x, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.ln(x))

    @torch.no_grad()
    def sample(self, y, top_k=100, temp=1.0):
        idx = torch.zeros(y.shape[0], 1, dtype=torch.long, device=y.device)
        for i in range(self.seq):
            logits = self(idx, y)[:, -1] / temp
            kth = logits.topk(top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
            nxt = torch.multinomial(F.softmax(logits, -1), 1)
            idx = torch.cat([idx[:, :i], nxt, idx.new_zeros(y.shape[0], 1)], 1)
        return idx[:, : self.seq]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--vqgan_cfg", required=True)
    ap.add_argument("--vqgan_ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=4.5e-6, help="base lr, scaled by global batch size")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--sample_every", type=int, default=5)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    tf = transforms.Compose([transforms.Resize(256), transforms.RandomCrop(256), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), transforms.Lambda(lambda t: t * 2 - 1)])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=10, pin_memory=True, drop_last=True)

    vqgan = load_vqgan(args.vqgan_cfg, args.vqgan_ckpt).to(device)
    gpt = GPT().to(local_rank)
    gpt = DDP(gpt, device_ids=[local_rank])
    lr = args.lr * args.bs * world
    opt = torch.optim.AdamW(gpt.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {args.bs * world}, lr {lr:.2e}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        gpt.train()
        t0 = time.time()
        for x, y in dl:
            codes = encode(vqgan, x.to(device, non_blocking=True)).to(local_rank)
            y = y.to(local_rank, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = gpt(codes, y)
            loss = F.cross_entropy(logits.float().flatten(0, 1), codes.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                lt = loss.detach().clone()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {lt.item():.4f} {(time.time() - t0) / 100:.3f}s/it",
                          flush=True)
                    t0 = time.time()

        if rank == 0:
            torch.save({"gpt": gpt.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "gpt_last.pt"))
            if (epoch + 1) % args.sample_every == 0:
                gpt.eval()
                y = torch.tensor([1, 88, 207, 279, 360, 387, 417, 980], device=local_rank)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    idx = gpt.module.sample(y)
                img = decode(vqgan, idx.to(device)).float().clamp(-1, 1)
                save_image(img * 0.5 + 0.5, os.path.join(args.out, f"samples_ep{epoch:03d}.png"), nrow=4)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
