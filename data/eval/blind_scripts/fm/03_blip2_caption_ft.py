"""BLIP-2 caption fine-tuning on COCO with FSDP (Q-Former + projection trained).

Launch:
    torchrun --nnodes 1 --nproc_per_node 8 03_blip2_caption_ft.py --config configs/blip2_coco.yaml
"""
import argparse
import functools
import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import yaml
from PIL import Image
from pycocoevalcap.cider.cider import Cider
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import Blip2ForConditionalGeneration, Blip2Processor, get_linear_schedule_with_warmup
from transformers.models.blip_2.modeling_blip_2 import Blip2EncoderLayer, Blip2QFormerLayer
from transformers.models.opt.modeling_opt import OPTDecoderLayer


@dataclass
class Config:
    model_name: str = "Salesforce/blip2-opt-2.7b"
    coco_root: str = "/datasets/coco2017"
    train_ann: str = "annotations/captions_train2017.json"
    val_ann: str = "annotations/captions_val2017.json"
    output_dir: str = "outputs/blip2-coco"
    batch_size: int = 16
    eval_batch_size: int = 32
    lr: float = 1e-5
    warmup_steps: int = 500
    epochs: int = 3
    max_new_tokens: int = 30
    num_beams: int = 3
    num_workers: int = 6
    trainable: list = field(default_factory=lambda: ["qformer", "query_tokens", "language_projection"])


class CocoCaptions(Dataset):
    def __init__(self, root, ann_file, split_dir, processor, train=True):
        with open(os.path.join(root, ann_file)) as f:
            ann = json.load(f)
        self.id2file = {im["id"]: im["file_name"] for im in ann["images"]}
        if train:
            self.items = [(a["image_id"], a["caption"]) for a in ann["annotations"]]
        else:
            self.items = [(i, None) for i in sorted(self.id2file)]
            self.refs = {}
            for a in ann["annotations"]:
                self.refs.setdefault(a["image_id"], []).append(a["caption"])
        self.img_dir = os.path.join(root, split_dir)
        self.processor = processor
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        image_id, caption = self.items[i]
        img = Image.open(os.path.join(self.img_dir, self.id2file[image_id])).convert("RGB")
        pixel_values = self.processor(images=img, return_tensors="pt").pixel_values[0]
        if not self.train:
            return pixel_values, image_id
        tok = self.processor.tokenizer(caption.strip(), max_length=40, truncation=True,
                                       padding="max_length", return_tensors="pt")
        return pixel_values, tok.input_ids[0], tok.attention_mask[0]


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    return cfg


def init_distributed():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)


def build_model(cfg, device):
    model = Blip2ForConditionalGeneration.from_pretrained(cfg.model_name, torch_dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad = any(name.startswith(t) for t in cfg.trainable)
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={Blip2EncoderLayer, Blip2QFormerLayer, OPTDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=policy,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=device,
        use_orig_params=True,
    )
    return model


@torch.no_grad()
def evaluate(model, loader, processor, refs, cfg, device, rank):
    model.eval()
    preds = {}
    for pixel_values, image_ids in loader:
        pixel_values = pixel_values.to(device, dtype=torch.bfloat16)
        out = model.module.generate(pixel_values=pixel_values, max_new_tokens=cfg.max_new_tokens,
                                    num_beams=cfg.num_beams)
        texts = processor.batch_decode(out, skip_special_tokens=True)
        for iid, txt in zip(image_ids.tolist(), texts):
            preds[iid] = txt.strip()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, preds)
    model.train()
    if rank != 0:
        return None
    merged = {}
    for d in gathered:
        merged.update(d)
    gts = {iid: refs[iid] for iid in merged}
    res = {iid: [merged[iid]] for iid in merged}
    score, _ = Cider().compute_score(gts, res)
    return score


def save_model(model, cfg, tag, rank):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        trainable = {k: v for k, v in sd.items() if any(k.startswith(t) for t in cfg.trainable)}
        os.makedirs(cfg.output_dir, exist_ok=True)
        torch.save(trainable, os.path.join(cfg.output_dir, f"blip2_{tag}.pt"))
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = load_config(ap.parse_args().config)
    rank, world, device = init_distributed()

    processor = Blip2Processor.from_pretrained(cfg.model_name)
    train_ds = CocoCaptions(cfg.coco_root, cfg.train_ann, "train2017", processor, train=True)
    val_ds = CocoCaptions(cfg.coco_root, cfg.val_ann, "val2017", processor, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.eval_batch_size, sampler=val_sampler,
                            num_workers=cfg.num_workers, pin_memory=True)

    model = build_model(cfg, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=cfg.lr, weight_decay=0.05)
    total = cfg.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, cfg.warmup_steps, total)

    best = -1.0
    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for pixel_values, input_ids, attn in train_loader:
            pixel_values = pixel_values.to(device, non_blocking=True)
            input_ids = input_ids.to(device, non_blocking=True)
            attn = attn.to(device, non_blocking=True)
            labels = input_ids.masked_fill(attn == 0, -100)
            out = model(pixel_values=pixel_values, input_ids=input_ids, attention_mask=attn, labels=labels)
            out.loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"[ep {epoch}] step {step}/{total} loss {out.loss.item():.4f}", flush=True)

        cider = evaluate(model, val_loader, processor, val_ds.refs, cfg, device, rank)
        is_best = torch.tensor([0], device=device)
        if rank == 0:
            print(f"epoch {epoch}: CIDEr {cider:.4f}", flush=True)
            if cider > best:
                best = cider
                is_best.fill_(1)
        dist.broadcast(is_best, src=0)
        if is_best.item():
            save_model(model, cfg, "best", rank)
        save_model(model, cfg, "last", rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
