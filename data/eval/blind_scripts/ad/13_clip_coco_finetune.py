"""Fine-tune openai/clip-vit-base-patch32 on COCO Captions (Karpathy split) for image-text retrieval.

    torchrun --nproc_per_node=4 13_clip_coco_finetune.py --coco-root /data/coco \
        --karpathy-json /data/coco/dataset_coco.json --output-dir outputs/clip_coco_ft
"""
import argparse
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import CLIPModel, CLIPProcessor, get_cosine_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-name", default="openai/clip-vit-base-patch32")
    parser.add_argument("--coco-root", required=True)
    parser.add_argument("--karpathy-json", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--lr", type=float, default=1e-5, help="for a global batch of 512")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--warmup-ratio", type=float, default=0.1)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class CocoKarpathy(Dataset):
    def __init__(self, root, karpathy_json, split, processor, train=True):
        with open(karpathy_json) as f:
            images = json.load(f)["images"]
        splits = {"train": ("train", "restval"), "val": ("val",), "test": ("test",)}[split]
        self.items = []
        for img in images:
            if img["split"] not in splits:
                continue
            path = os.path.join(root, img["filepath"], img["filename"])
            caps = [s["raw"].strip() for s in img["sentences"]]
            if train:
                self.items.extend((path, c) for c in caps)
            else:
                self.items.append((path, caps[:5]))
        self.processor = processor
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, cap = self.items[i]
        image = Image.open(path).convert("RGB")
        pixel_values = self.processor(images=image, return_tensors="pt")["pixel_values"][0]
        return pixel_values, cap


def train_collate(processor):
    def fn(batch):
        pixels, caps = zip(*batch)
        tok = processor.tokenizer(list(caps), padding=True, truncation=True, max_length=77, return_tensors="pt")
        return torch.stack(pixels), tok["input_ids"], tok["attention_mask"]
    return fn


def gather_with_grad(x):
    """all_gather; our own slice keeps its gradient."""
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.detach())
    out[dist.get_rank()] = x
    return torch.cat(out, dim=0)


def clip_loss(image_embeds, text_embeds, logit_scale):
    all_img = gather_with_grad(image_embeds)
    all_txt = gather_with_grad(text_embeds)
    n = image_embeds.size(0)
    labels = torch.arange(n, device=image_embeds.device) + dist.get_rank() * n
    logits_i2t = logit_scale * image_embeds @ all_txt.t()
    logits_t2i = logit_scale * text_embeds @ all_img.t()
    return (F.cross_entropy(logits_i2t, labels) + F.cross_entropy(logits_t2i, labels)) / 2


@torch.no_grad()
def evaluate(model, dataset, processor, device, batch_size=256):
    model.eval()
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=8, collate_fn=lambda b: b)
    img_embs, txt_embs, txt_to_img = [], [], []
    for batch in loader:
        pixels = torch.stack([p for p, _ in batch]).to(device)
        img_embs.append(F.normalize(model.get_image_features(pixel_values=pixels), dim=-1))
        caps = [c for _, cs in batch for c in cs]
        tok = processor.tokenizer(caps, padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
        txt_embs.append(F.normalize(model.get_text_features(**tok), dim=-1))
        base = sum(e.size(0) for e in img_embs[:-1])
        for j, (_, cs) in enumerate(batch):
            txt_to_img.extend([base + j] * len(cs))
    img_embs, txt_embs = torch.cat(img_embs), torch.cat(txt_embs)
    txt_to_img = torch.tensor(txt_to_img, device=device)
    sim = txt_embs @ img_embs.t()
    res = {}
    for k in (1, 5, 10):
        res[f"t2i_R@{k}"] = (sim.topk(k, dim=1).indices == txt_to_img[:, None]).any(1).float().mean().item()
        top_txt = sim.t().topk(k, dim=1).indices
        res[f"i2t_R@{k}"] = (txt_to_img[top_txt] == torch.arange(sim.size(1), device=device)[:, None]) \
            .any(1).float().mean().item()
    model.train()
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    processor = CLIPProcessor.from_pretrained(args.model_name)
    model = CLIPModel.from_pretrained(args.model_name).to(device)

    train_ds = CocoKarpathy(args.coco_root, args.karpathy_json, "train", processor)
    val_ds = CocoKarpathy(args.coco_root, args.karpathy_json, "val", processor, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, collate_fn=train_collate(processor))

    params_decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    params_no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.AdamW([{"params": params_decay, "weight_decay": args.weight_decay},
                                   {"params": params_no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    total_steps = len(loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    model = DDP(model, device_ids=[local_rank])
    best = -1.0
    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for pixel_values, input_ids, attention_mask in loader:
            pixel_values = pixel_values.to(device, non_blocking=True)
            input_ids = input_ids.to(device, non_blocking=True)
            attention_mask = attention_mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask)
            loss = clip_loss(out.image_embeds.float(), out.text_embeds.float(), model.module.logit_scale.exp())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            global_step += 1
            if global_step % 50 == 0:
                logged = loss.detach()
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, global_step, logged.item(),
                            scheduler.get_last_lr()[0])

        if rank == 0:
            metrics = evaluate(model, val_ds, processor, device)
            logger.info("epoch %d val %s", epoch, json.dumps({k: round(v, 4) for k, v in metrics.items()}))
            rsum = sum(metrics.values())
            if rsum > best:
                best = rsum
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
