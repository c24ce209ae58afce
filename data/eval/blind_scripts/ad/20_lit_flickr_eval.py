"""LiT (locked-image text tuning): frozen pretrained ViT image tower, text tower trained with a
contrastive loss over the global batch. Flickr30k retrieval is evaluated after every epoch.

    torchrun --nproc_per_node=8 20_lit_flickr_eval.py --train-list /data/cc12m/train.tsv \
        --flickr-root /data/flickr30k --output-dir /ckpt/lit_b16
"""
import argparse
import json
import logging
import math
import os

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoModel, AutoTokenizer

logger = logging.getLogger("lit")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-list", required=True)
    p.add_argument("--flickr-root", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--image-tower", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--text-tower", default="bert-base-uncased")
    p.add_argument("--batch-size", type=int, default=512, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for the global batch of 4096")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=1000)
    return p.parse_args()


class PairList(Dataset):
    def __init__(self, rows, tf, tok, root=""):
        self.rows, self.tf, self.tok, self.root = rows, tf, tok, root

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, caption = self.rows[i]
        img = self.tf(Image.open(os.path.join(self.root, path)).convert("RGB"))
        t = self.tok(caption, padding="max_length", truncation=True, max_length=64, return_tensors="pt")
        return img, t["input_ids"][0], t["attention_mask"][0], i


class LiT(nn.Module):
    def __init__(self, image_tower, text_tower, dim=768):
        super().__init__()
        self.visual = timm.create_model(image_tower, pretrained=True, num_classes=0)
        for p in self.visual.parameters():
            p.requires_grad = False
        self.text = AutoModel.from_pretrained(text_tower, add_pooling_layer=False)
        self.text_head = nn.Linear(self.text.config.hidden_size, self.visual.num_features)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def encode_image(self, x):
        with torch.no_grad():
            return F.normalize(self.visual(x), dim=-1)

    def encode_text(self, ids, mask):
        h = self.text(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return F.normalize(self.text_head(h), dim=-1)

    def forward(self, x, ids, mask):
        return self.encode_image(x), self.encode_text(ids, mask), self.logit_scale.exp()


def all_gather_concat(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


@torch.no_grad()
def flickr_retrieval(model, loader, device):
    """Recall@{1,5,10} on the 1k Flickr30k test images (5 captions each)."""
    net = model.module
    net.eval()
    img_f, txt_f, ids = [], [], []
    for img, tok_ids, mask, idx in loader:
        img_f.append(net.encode_image(img.to(device)))
        txt_f.append(net.encode_text(tok_ids.to(device), mask.to(device)))
        ids.append(idx.to(device))
    img_f = all_gather_concat(torch.cat(img_f))
    txt_f = all_gather_concat(torch.cat(txt_f))
    ids = all_gather_concat(torch.cat(ids))
    # rows are (image, caption) pairs; 5 consecutive rows share one image
    img_of_row = ids // 5
    order = torch.argsort(ids)
    img_of_row, img_f, txt_f = img_of_row[order], img_f[order], txt_f[order]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[1:] = ids[order][1:] != ids[order][:-1]  # padding duplicates from the sampler
    img_of_row, img_f, txt_f = img_of_row[keep], img_f[keep], txt_f[keep]
    uniq_img = img_f[::5]
    sim_t2i = txt_f @ uniq_img.t()
    res = {}
    for k in (1, 5, 10):
        res[f"t2i@{k}"] = (sim_t2i.topk(k, 1).indices == img_of_row[:, None]).any(1).float().mean().item()
        top_rows = sim_t2i.t().topk(k, 1).indices
        res[f"i2t@{k}"] = (img_of_row[top_rows] == torch.arange(len(uniq_img), device=device)[:, None]) \
            .any(1).float().mean().item()
    net.train()
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_master = rank == 0
    logging.basicConfig(level=logging.INFO if is_master else logging.WARNING)

    tok = AutoTokenizer.from_pretrained(args.text_tower)
    model = LiT(args.image_tower, args.text_tower).to(device)
    cfg = model.visual.pretrained_cfg
    tf = transforms.Compose([transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
                             transforms.CenterCrop(224), transforms.ToTensor(),
                             transforms.Normalize(cfg["mean"], cfg["std"])])

    df = pd.read_csv(args.train_list, sep="\t", names=["path", "caption"])
    train_set = PairList(list(zip(df.path, df.caption)), tf, tok)
    with open(os.path.join(args.flickr_root, "flickr30k_test_karpathy.json")) as f:
        test = json.load(f)
    test_rows = [(os.path.join("flickr30k-images", e["image"]), c) for e in test for c in e["caption"][:5]]
    test_set = PairList(test_rows, tf, tok, root=args.flickr_root)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=10,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=8)

    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.batch_size * world / 4096
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    total = len(train_loader) * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi * s / total)))

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for img, ids, mask, _ in train_loader:
            img, ids, mask = img.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                zimg, ztxt, scale = model(img, ids, mask)
            zimg, ztxt = zimg.float(), ztxt.float()
            all_img = all_gather_concat(zimg)  # image tower is frozen: no gradient needed
            all_txt = torch.cat(torch.distributed.nn.all_gather(ztxt))
            labels = torch.arange(zimg.size(0), device=device) + rank * zimg.size(0)
            loss = (F.cross_entropy(scale * zimg @ all_txt.t(), labels)
                    + F.cross_entropy(scale * ztxt @ all_img.t(), labels)) / 2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.4f scale %.2f", epoch, step, total, l.item(), scale.item())

        if is_master:
            metrics = flickr_retrieval(model, test_loader, device)
            logger.info("epoch %d flickr30k %s", epoch, json.dumps(metrics))
            os.makedirs(args.output_dir, exist_ok=True)
            state = {k: v for k, v in model.module.state_dict().items() if not k.startswith("visual.")}
            torch.save({"text_tower": state, "epoch": epoch, "metrics": metrics},
                       os.path.join(args.output_dir, f"lit_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
