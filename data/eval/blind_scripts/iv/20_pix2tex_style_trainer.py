"""pix2tex-style LaTeX OCR trainer: hybrid ResNet + ViT encoder, x-transformers decoder,
BPE tokenizer, auto-resume from <out>/checkpoint.pth.

    torchrun --nproc_per_node=4 20_pix2tex_style_trainer.py --config config.yaml
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import timm
import yaml
from munch import Munch
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchtext.data.metrics import bleu_score
from transformers import PreTrainedTokenizerFast
from x_transformers import Decoder, TransformerWrapper
import torchvision.transforms.functional as TF


class Im2LatexPairs(Dataset):
    def __init__(self, equations, images, tokenizer, max_w, max_h, patch):
        eqs = open(equations, encoding="utf-8").read().split("\n")
        self.pairs = []
        for name in sorted(os.listdir(images)):
            idx = int(os.path.splitext(name)[0])
            self.pairs.append((os.path.join(images, name), eqs[idx]))
        self.tok, self.max_w, self.max_h, self.patch = tokenizer, max_w, max_h, patch

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        path, eq = self.pairs[i]
        im = Image.open(path).convert("L")
        r = min(1.0, self.max_w / im.width, self.max_h / im.height)
        w = max(self.patch, int(im.width * r) // self.patch * self.patch)
        h = max(self.patch, int(im.height * r) // self.patch * self.patch)
        x = TF.normalize(TF.to_tensor(im.resize((w, h), Image.BILINEAR)), [0.7931], [0.1738])
        return x, eq


def make_collate(tok, max_seq):
    def collate(batch):
        xs, eqs = zip(*batch)
        H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
        img = torch.full((len(xs), 1, H, W), (1 - 0.7931) / 0.1738)
        for i, x in enumerate(xs):
            img[i, :, : x.shape[1], : x.shape[2]] = x
        enc = tok(list(eqs), padding=True, truncation=True, max_length=max_seq - 2, return_tensors="pt")
        ids = enc["input_ids"]
        bos = torch.full((ids.shape[0], 1), tok.bos_token_id)
        eos_pos = enc["attention_mask"].sum(1)
        ids = torch.cat([bos, ids, torch.full_like(bos, tok.pad_token_id)], 1)
        ids[torch.arange(ids.shape[0]), eos_pos + 1] = tok.eos_token_id
        return img, ids
    return collate


class HybridEncoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.backbone = timm.create_model("resnet26d", pretrained=False, in_chans=1, features_only=True,
                                          out_indices=(3,))         # stride 16
        self.proj = nn.Conv2d(self.backbone.feature_info.channels()[-1], a.dim, 1)
        self.grid_w = a.max_width // a.patch_size
        self.pos = nn.Parameter(torch.randn(1, (a.max_height // a.patch_size) * self.grid_w, a.dim) * 0.02)
        self.vit = nn.TransformerEncoder(nn.TransformerEncoderLayer(a.dim, a.heads, 4 * a.dim, 0.1, "gelu",
                                                                    batch_first=True, norm_first=True),
                                         a.encoder_depth)
        self.norm = nn.LayerNorm(a.dim)

    def forward(self, x):
        f = self.proj(self.backbone(x)[-1])
        B, C, h, w = f.shape
        idx = (torch.arange(h, device=x.device)[:, None] * self.grid_w + torch.arange(w, device=x.device)).flatten()
        t = f.flatten(2).transpose(1, 2) + self.pos[:, idx]
        return self.norm(self.vit(t))


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.encoder = HybridEncoder(a)
        self.decoder = TransformerWrapper(num_tokens=a.num_tokens, max_seq_len=a.max_seq_len,
                                          attn_layers=Decoder(dim=a.dim, depth=a.num_layers, heads=a.heads,
                                                              cross_attend=True, ff_glu=True, rel_pos_bias=False,
                                                              use_scalenorm=True))

    def forward(self, img, tgt_in):
        return self.decoder(tgt_in, context=self.encoder(img))

    @torch.no_grad()
    def generate(self, img, bos, eos, max_len, temperature=0.0):
        ctx = self.encoder(img)
        out = torch.full((img.shape[0], 1), bos, dtype=torch.long, device=img.device)
        for _ in range(max_len - 1):
            logits = self.decoder(out, context=ctx)[:, -1]
            nxt = logits.argmax(-1) if temperature == 0 else torch.multinomial((logits / temperature).softmax(-1), 1)[:, 0]
            out = torch.cat([out, nxt[:, None]], 1)
            if (out == eos).any(1).all():
                break
        return out


def detok(tok, ids):
    out = []
    for seq in ids.tolist():
        if tok.eos_token_id in seq[1:]:
            seq = seq[: seq.index(tok.eos_token_id, 1)]
        out.append(tok.decode(seq[1:], skip_special_tokens=True).replace("Ġ", " ").split())
    return out


def save_checkpoint(path, model, opt, sched, epoch, best):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "best": best}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="config.yaml")
    a = Munch(yaml.safe_load(open(ap.parse_args().config)))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(a.get("seed", 42))

    tok = PreTrainedTokenizerFast(tokenizer_file=a.tokenizer)
    tok.add_special_tokens({"pad_token": "[PAD]", "bos_token": "[BOS]", "eos_token": "[EOS]"})
    a.num_tokens = len(tok)
    collate = make_collate(tok, a.max_seq_len)
    train = Im2LatexPairs(a.equations, a.train_images, tok, a.max_width, a.max_height, a.patch_size)
    val = Im2LatexPairs(a.equations, a.val_images, tok, a.max_width, a.max_height, a.patch_size)
    sampler = DistributedSampler(train, shuffle=True, seed=a.get("seed", 42))
    train_dl = DataLoader(train, a.batchsize, sampler=sampler, collate_fn=collate, num_workers=a.num_workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val, a.testbatchsize, sampler=DistributedSampler(val, shuffle=False), collate_fn=collate,
                        num_workers=a.num_workers)

    model = Model(a)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=a.lr_step, gamma=a.gamma)

    os.makedirs(a.out_path, exist_ok=True)
    ckpt_path = os.path.join(a.out_path, "checkpoint.pth")
    start, best = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start, a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (img, ids) in enumerate(train_dl):
            img, ids = img.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            logits = model(img, ids[:, :-1])
            loss = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], ignore_index=tok.pad_token_id)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_dl)}] loss {loss.item():.4f}", flush=True)

        model.eval()
        hyps, refs = [], []
        for img, ids in val_dl:
            pred = model.module.generate(img.to(device), tok.bos_token_id, tok.eos_token_id, a.max_seq_len)
            hyps += detok(tok, pred)
            refs += [[r] for r in detok(tok, ids)]
        gathered = [None] * world
        dist.all_gather_object(gathered, (hyps, refs))
        all_h = [h for g in gathered for h in g[0]]
        all_r = [r for g in gathered for r in g[1]]
        bleu = bleu_score(all_h, all_r)
        em = sum(h == r[0] for h, r in zip(all_h, all_r)) / len(all_h)
        if rank == 0:
            print(f"epoch {epoch}: BLEU {bleu:.4f}  exact {em:.4f}", flush=True)
        best = max(best, bleu)
        save_checkpoint(ckpt_path, model, opt, sched, epoch, best)
        if bleu >= best:
            torch.save(model.module.state_dict(), os.path.join(a.out_path, "best_weights.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
