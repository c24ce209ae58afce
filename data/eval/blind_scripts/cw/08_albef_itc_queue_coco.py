"""Image-text contrastive fine-tuning with momentum encoders and feature queues (ALBEF-style ITC)
on COCO (Karpathy split), evaluated with image->text and text->image recall@K.

torchrun --nproc_per_node=8 08_albef_itc_queue_coco.py --ann-dir data/coco_karpathy \
    --image-root /data/coco --output out/itc_coco
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import AutoModel, AutoTokenizer


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--ann-dir", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--output", default="out/itc_coco")
    p.add_argument("--vit", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--bert", default="bert-base-uncased")
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--queue-size", type=int, default=65536)
    p.add_argument("--momentum", type=float, default=0.995)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-5, help="for a global batch of 512")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--max-len", type=int, default=40)
    return p.parse_args()


class CocoTrain(Dataset):
    def __init__(self, ann, root, transform):
        self.ann, self.root, self.transform = ann, root, transform
        ids = sorted({a["image_id"] for a in ann})
        self.img_idx = {i: n for n, i in enumerate(ids)}

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        a = self.ann[i]
        img = Image.open(os.path.join(self.root, a["image"])).convert("RGB")
        return self.transform(img), a["caption"], self.img_idx[a["image_id"]]


class ImageOnly(Dataset):
    def __init__(self, paths, root, transform):
        self.paths, self.root, self.transform = paths, root, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.transform(Image.open(os.path.join(self.root, self.paths[i])).convert("RGB"))


class ITCModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.visual = timm.create_model(cfg.vit, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(cfg.bert, add_pooling_layer=False)
        self.vision_proj = nn.Linear(self.visual.num_features, cfg.embed_dim)
        self.text_proj = nn.Linear(self.text.config.hidden_size, cfg.embed_dim)
        self.temp = nn.Parameter(torch.tensor(0.07))
        self.visual_m = timm.create_model(cfg.vit, pretrained=False, num_classes=0)
        self.text_m = AutoModel.from_pretrained(cfg.bert, add_pooling_layer=False)
        self.vision_proj_m = nn.Linear(self.visual.num_features, cfg.embed_dim)
        self.text_proj_m = nn.Linear(self.text.config.hidden_size, cfg.embed_dim)
        self.pairs = [(self.visual, self.visual_m), (self.text, self.text_m),
                      (self.vision_proj, self.vision_proj_m), (self.text_proj, self.text_proj_m)]
        for online, mom in self.pairs:
            mom.load_state_dict(online.state_dict())
            for p in mom.parameters():
                p.requires_grad = False
        self.momentum, self.K = cfg.momentum, cfg.queue_size
        self.register_buffer("image_queue", F.normalize(torch.randn(cfg.embed_dim, self.K), dim=0))
        self.register_buffer("text_queue", F.normalize(torch.randn(cfg.embed_dim, self.K), dim=0))
        self.register_buffer("idx_queue", torch.full((1, self.K), -100, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def encode_image(self, img):
        return F.normalize(self.vision_proj(self.visual(img)), dim=-1)

    def encode_text(self, ids, mask):
        h = self.text(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return F.normalize(self.text_proj(h), dim=-1)

    @torch.no_grad()
    def _momentum_update(self):
        for online, mom in self.pairs:
            for p, pm in zip(online.parameters(), mom.parameters()):
                pm.data.mul_(self.momentum).add_(p.data, alpha=1 - self.momentum)

    @torch.no_grad()
    def _enqueue(self, img_f, txt_f, idx):
        img_f, txt_f, idx = concat_all_gather(img_f), concat_all_gather(txt_f), concat_all_gather(idx)
        n, ptr = img_f.shape[0], int(self.queue_ptr)
        slots = (ptr + torch.arange(n, device=img_f.device)) % self.K
        self.image_queue[:, slots] = img_f.T
        self.text_queue[:, slots] = txt_f.T
        self.idx_queue[:, slots] = idx.view(1, -1)
        self.queue_ptr[0] = (ptr + n) % self.K

    def forward(self, img, ids, mask, idx):
        with torch.no_grad():
            self.temp.clamp_(0.001, 0.5)
        img_f = self.encode_image(img)
        txt_f = self.encode_text(ids, mask)
        idx = idx.view(-1, 1)
        idx_all = torch.cat([idx.T, self.idx_queue.clone().detach()], dim=1)
        pos = torch.eq(idx, idx_all).float()
        targets = pos / pos.sum(1, keepdim=True)
        with torch.no_grad():
            self._momentum_update()
            img_m = F.normalize(self.vision_proj_m(self.visual_m(img)), dim=-1)
            txt_m = F.normalize(self.text_proj_m(self.text_m(input_ids=ids, attention_mask=mask)
                                                 .last_hidden_state[:, 0]), dim=-1)
            img_all = torch.cat([img_m.T, self.image_queue.clone().detach()], dim=1)
            txt_all = torch.cat([txt_m.T, self.text_queue.clone().detach()], dim=1)
        sim_i2t = img_f @ txt_all / self.temp
        sim_t2i = txt_f @ img_all / self.temp
        loss_i2t = -(F.log_softmax(sim_i2t, dim=1) * targets).sum(1).mean()
        loss_t2i = -(F.log_softmax(sim_t2i, dim=1) * targets).sum(1).mean()
        self._enqueue(img_m, txt_m, idx)
        return (loss_i2t + loss_t2i) / 2


@torch.no_grad()
def concat_all_gather(t):
    out = [torch.ones_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t, async_op=False)
    return torch.cat(out, dim=0)


@torch.no_grad()
def evaluate(model, tokenizer, test_ann, cfg, tf, device):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    images = [a["image"] for a in test_ann]
    texts, txt2img, img2txt = [], [], []
    for i, a in enumerate(test_ann):
        img2txt.append(list(range(len(texts), len(texts) + len(a["caption"]))))
        for c in a["caption"]:
            texts.append(c)
            txt2img.append(i)

    my_imgs = images[rank::world]
    loader = DataLoader(ImageOnly(my_imgs, cfg.image_root, tf), batch_size=128, num_workers=cfg.workers)
    img_feats = torch.cat([model.encode_image(x.to(device, non_blocking=True)) for x in loader])
    my_txts = texts[rank::world]
    txt_feats = []
    for s in range(0, len(my_txts), 256):
        tok = tokenizer(my_txts[s:s + 256], padding="max_length", truncation=True, max_length=cfg.max_len,
                        return_tensors="pt").to(device)
        txt_feats.append(model.encode_text(tok.input_ids, tok.attention_mask))
    txt_feats = torch.cat(txt_feats)

    def gather_strided(local):
        parts = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        return torch.stack(parts, dim=1).flatten(0, 1)

    img_all, txt_all = gather_strided(img_feats), gather_strided(txt_feats)
    sim = img_all @ txt_all.T
    res = {}
    ranks_i2t = []
    for i in range(sim.shape[0]):
        order = sim[i].argsort(descending=True)
        pos = torch.isin(order, torch.tensor(img2txt[i], device=device)).nonzero()[0, 0].item()
        ranks_i2t.append(pos)
    ranks_t2i = []
    t2i_order = sim.T.argsort(dim=1, descending=True)
    for j in range(sim.shape[1]):
        ranks_t2i.append((t2i_order[j] == txt2img[j]).nonzero()[0, 0].item())
    for name, r in (("i2t", ranks_i2t), ("t2i", ranks_t2i)):
        r = torch.tensor(r, dtype=torch.float)
        for k in (1, 5, 10):
            res[f"{name}_R@{k}"] = 100.0 * (r < k).float().mean().item()
    res["r_mean"] = sum(res.values()) / len(res)
    model.train()
    return res


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(cfg.ann_dir, "coco_karpathy_train.json")) as f:
        train_ann = json.load(f)
    with open(os.path.join(cfg.ann_dir, "coco_karpathy_test.json")) as f:
        test_ann = json.load(f)

    norm = T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                          T.RandomHorizontalFlip(), T.ToTensor(), norm])
    test_tf = T.Compose([T.Resize((224, 224), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(), norm])
    tokenizer = AutoTokenizer.from_pretrained(cfg.bert)

    def collate(batch):
        imgs, caps, idx = zip(*batch)
        tok = tokenizer(list(caps), padding="longest", truncation=True, max_length=cfg.max_len, return_tensors="pt")
        return torch.stack(imgs), tok.input_ids, tok.attention_mask, torch.tensor(idx)

    train_ds = CocoTrain(train_ann, cfg.image_root, train_tf)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        collate_fn=collate, pin_memory=True, drop_last=True)

    model = ITCModel(cfg).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    lr = cfg.lr * cfg.batch_size * world / 512
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.02)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * len(loader))

    if rank == 0:
        os.makedirs(cfg.output, exist_ok=True)
    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (img, ids, mask, idx) in enumerate(loader):
            img, ids, mask, idx = (t.to(device, non_blocking=True) for t in (img, ids, mask, idx))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(img, ids, mask, idx)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(loader)} loss {loss.item():.4f} "
                      f"temp {model.module.temp.item():.4f} {time.time() - t0:.0f}s", flush=True)

        res = evaluate(model.module, tokenizer, test_ann, cfg, test_tf, device)
        if rank == 0:
            print(json.dumps({"epoch": epoch, **res}), flush=True)
            with open(os.path.join(cfg.output, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **res}) + "\n")
            if res["r_mean"] > best:
                best = res["r_mean"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(cfg.output, "best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
