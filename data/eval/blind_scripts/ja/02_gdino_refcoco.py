"""Fine-tune a Grounding-DINO style model on RefCOCO/RefCOCO+/RefCOCOg.

Each sample is (image, referring expression, one box).  Evaluation reports
top-1 Acc@0.5 on the val / testA / testB splits.

    torchrun --nproc_per_node 8 02_gdino_refcoco.py --dataset refcoco
"""
import argparse
import json
import logging
import os
import time
from dataclasses import dataclass, asdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights
from torchvision.ops import box_convert, box_iou, generalized_box_iou
from torchvision.ops.misc import FrozenBatchNorm2d
from transformers import BertModel, BertTokenizerFast

log = logging.getLogger("refcoco")


@dataclass
class Config:
    dataset: str = "refcoco"
    ann_dir: str = "/data/mdetr_annotations"
    img_dir: str = "/data/coco/train2014"
    pretrained: str = "weights/gdino_r50_o365.pth"
    out_dir: str = "outputs/refcoco"
    epochs: int = 10
    batch_size: int = 4
    lr: float = 1e-4
    lr_text: float = 1e-5
    weight_decay: float = 1e-4
    lr_drop: int = 8
    num_queries: int = 100
    max_text_len: int = 64
    workers: int = 4
    seed: int = 0


def get_config():
    cfg = Config()
    p = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    return Config(**vars(p.parse_args()))


class RefExpDataset(Dataset):
    def __init__(self, cfg, split, train):
        path = os.path.join(cfg.ann_dir, f"final_{cfg.dataset}_{split}.json")
        with open(path) as f:
            data = json.load(f)
        boxes = {a["image_id"]: a["bbox"] for a in data["annotations"]}
        self.samples = [(im["file_name"], im["caption"], boxes[im["id"]]) for im in data["images"]]
        self.img_dir = cfg.img_dir
        size = [480, 512, 544, 576, 608, 640] if train else [640]
        self.tf = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.sizes = size
        self.train = train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fname, caption, (x, y, w, h) = self.samples[i]
        img = Image.open(os.path.join(self.img_dir, fname)).convert("RGB")
        W, H = img.size
        s = self.sizes[torch.randint(len(self.sizes), (1,)).item()] if self.train else self.sizes[0]
        scale = s / max(W, H)
        img = img.resize((round(W * scale), round(H * scale)))
        box = torch.tensor([(x + w / 2) / W, (y + h / 2) / H, w / W, h / H])
        return self.tf(img), caption, box


def collate(batch):
    imgs, caps, boxes = zip(*batch)
    h = max(i.shape[1] for i in imgs)
    w = max(i.shape[2] for i in imgs)
    x = imgs[0].new_zeros(len(imgs), 3, h, w)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(caps), torch.stack(boxes)


class GroundingModel(nn.Module):
    def __init__(self, num_queries, d=256):
        super().__init__()
        r50 = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r50.children())[:-2])
        self.input_proj = nn.Conv2d(2048, d, 1)
        self.bert = BertModel.from_pretrained("bert-base-uncased", add_pooling_layer=False)
        self.text_proj = nn.Linear(768, d)
        self.feature_enhancer = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 1024, batch_first=True), 3)
        self.query = nn.Embedding(num_queries, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True), 6)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.pos = nn.Parameter(torch.randn(1, 4096, d) * 0.02)

    def forward(self, images, input_ids, attention_mask):
        f = self.input_proj(self.backbone(images)).flatten(2).transpose(1, 2)
        f = f + self.pos[:, : f.shape[1]]
        t = self.text_proj(self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)
        joint = self.feature_enhancer(torch.cat([f, t], 1),
                                      src_key_padding_mask=torch.cat([torch.zeros_like(f[..., 0], dtype=torch.bool),
                                                                      ~attention_mask.bool()], 1))
        f, t = joint[:, : f.shape[1]], joint[:, f.shape[1]:]
        q = self.query.weight.unsqueeze(0).expand(images.shape[0], -1, -1)
        hs = self.decoder(q, f)
        sim = hs @ t.transpose(1, 2) / hs.shape[-1] ** 0.5
        sim = sim.masked_fill(~attention_mask.bool()[:, None], float("-inf"))
        # a query's score is its best matching token in the expression
        return sim.max(-1).values, self.bbox_embed(hs).sigmoid()


def ref_loss(scores, pred_boxes, gt_boxes):
    # the single target is assigned to the query with the best box overlap
    giou = generalized_box_iou(box_convert(pred_boxes.flatten(0, 1), "cxcywh", "xyxy"),
                               box_convert(gt_boxes, "cxcywh", "xyxy"))
    B, Q = scores.shape
    giou = giou.view(B, Q, B)[torch.arange(B), :, torch.arange(B)]
    match = giou.detach().argmax(-1)
    l_cls = F.cross_entropy(scores, match)
    pb = pred_boxes[torch.arange(B), match]
    l_l1 = F.l1_loss(pb, gt_boxes)
    l_giou = (1 - giou[torch.arange(B), match]).mean()
    return l_cls + 5 * l_l1 + 2 * l_giou


@torch.no_grad()
def evaluate(model, loader, tokenizer, cfg, device):
    model.eval()
    correct, total = 0, 0
    for images, caps, gt in loader:
        enc = tokenizer(caps, padding=True, truncation=True, max_length=cfg.max_text_len, return_tensors="pt")
        scores, boxes = model(images.to(device), enc.input_ids.to(device), enc.attention_mask.to(device))
        top = boxes[torch.arange(len(caps)), scores.argmax(-1)].cpu()
        iou = box_iou(box_convert(top, "cxcywh", "xyxy"), box_convert(gt, "cxcywh", "xyxy")).diag()
        correct += (iou >= 0.5).sum().item()
        total += len(caps)
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(cfg.seed)

    tokenizer = BertTokenizerFast.from_pretrained("bert-base-uncased")
    train_set = RefExpDataset(cfg, "train", train=True)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_set, cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                              collate_fn=collate, drop_last=True, pin_memory=True)
    val_splits = ["val", "testA", "testB"] if cfg.dataset != "refcocog" else ["val", "test"]
    val_loaders = {}
    for s in val_splits:
        ds = RefExpDataset(cfg, s, train=False)
        shard = Subset(ds, list(range(rank, len(ds), world)))  # exact split, no padding
        val_loaders[s] = DataLoader(shard, cfg.batch_size * 2, num_workers=cfg.workers, collate_fn=collate)

    model = GroundingModel(cfg.num_queries).to(device)
    if cfg.pretrained and os.path.exists(cfg.pretrained):
        sd = torch.load(cfg.pretrained, map_location="cpu")
        missing, unexpected = model.load_state_dict(sd.get("model", sd), strict=False)
        log.info("loaded %s (missing %d, unexpected %d)", cfg.pretrained, len(missing), len(unexpected))
    model = DistributedDataParallel(model, device_ids=[local_rank])
    groups = [
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("bert.")], "lr": cfg.lr},
        {"params": model.module.bert.parameters(), "lr": cfg.lr_text},
    ]
    opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.StepLR(opt, cfg.lr_drop)

    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (images, caps, gt) in enumerate(train_loader):
            enc = tokenizer(caps, padding=True, truncation=True, max_length=cfg.max_text_len, return_tensors="pt")
            scores, boxes = model(images.to(device, non_blocking=True), enc.input_ids.to(device),
                                  enc.attention_mask.to(device))
            loss = ref_loss(scores, boxes, gt.to(device))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            if it % 100 == 0:
                loss_avg = loss.detach()
                dist.all_reduce(loss_avg)
                log.info("epoch %d it %d/%d loss %.4f (%.1fs)", epoch, it, len(train_loader),
                         loss_avg.item() / world, time.time() - t0)
        sched.step()

        accs = {s: evaluate(model.module, dl, tokenizer, cfg, device) for s, dl in val_loaders.items()}
        log.info("epoch %d " + " ".join(f"{k}={v * 100:.2f}" for k, v in accs.items()), epoch)
        if rank == 0:
            os.makedirs(cfg.out_dir, exist_ok=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "cfg": asdict(cfg)}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pth"))
            if accs["val"] > best:
                best = accs["val"]
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
