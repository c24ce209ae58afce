"""Donut fine-tuning for receipt parsing (CORD-v2 schema + our internal receipt fields).

Ground truth is a JSON tree per image; it is serialised to a token sequence with
<s_key>...</s_key> tags, following the Donut paper.

    torchrun --nproc_per_node=8 03_donut_cord_receipts.py --config configs/donut_cord.yaml
"""
import argparse
import json
import logging
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_cosine_schedule_with_warmup

logger = logging.getLogger("donut_cord")

TASK_START = "<s_cord-v2>"


@dataclass
class Config:
    pretrained: str = "naver-clova-ix/donut-base"
    dataset: str = "naver-clova-ix/cord-v2"
    output_dir: str = "/mnt/shared/runs/donut_cord"
    image_size: tuple = (1280, 960)
    max_length: int = 768
    batch_size: int = 2
    lr: float = 3e-5
    epochs: int = 30
    warmup_steps: int = 300
    grad_clip: float = 1.0
    num_workers: int = 4
    seed: int = 2022


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, tuple(v) if k == "image_size" else v)
    return cfg


def json2token(obj, keys_out, sort_keys=True):
    """Serialise a ground-truth dict into Donut's tag sequence, collecting the keys used."""
    if isinstance(obj, dict):
        if len(obj) == 1 and "text_sequence" in obj:
            return obj["text_sequence"]
        out = ""
        keys = sorted(obj.keys(), reverse=True) if sort_keys else obj.keys()
        for k in keys:
            keys_out.add(k)
            out += f"<s_{k}>" + json2token(obj[k], keys_out, sort_keys) + f"</s_{k}>"
        return out
    if isinstance(obj, list):
        return "<sep/>".join(json2token(x, keys_out, sort_keys) for x in obj)
    return str(obj)


class DonutParseDataset(Dataset):
    def __init__(self, hf_split, processor, cfg, keys_out):
        self.ds = hf_split
        self.processor = processor
        self.cfg = cfg
        self.targets = []
        for sample in hf_split:
            gt = json.loads(sample["ground_truth"])
            parses = gt["gt_parses"] if "gt_parses" in gt else [gt["gt_parse"]]
            self.targets.append([json2token(p, keys_out) + processor.tokenizer.eos_token for p in parses])

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, idx):
        sample = self.ds[idx]
        pixel_values = self.processor(sample["image"].convert("RGB"), return_tensors="pt").pixel_values[0]
        target = TASK_START + self.targets[idx][0]
        input_ids = self.processor.tokenizer(
            target, add_special_tokens=False, max_length=self.cfg.max_length,
            padding="max_length", truncation=True, return_tensors="pt",
        ).input_ids[0]
        labels = input_ids.clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        return pixel_values, labels, self.targets[idx][0]


def token2json_loose(seq):
    """Cheap field-level parse used for the validation F1 (flat keys only)."""
    fields = {}
    for key, value in re.findall(r"<s_(.+?)>(.*?)</s_\1>", seq):
        if "<s_" not in value:
            fields.setdefault(key, []).append(value.strip())
    return fields


def field_f1(preds, golds):
    tp = fp = fn = 0
    for p, g in zip(preds, golds):
        pf, gf = token2json_loose(p), token2json_loose(g)
        for k in set(pf) | set(gf):
            pv, gv = list(pf.get(k, [])), list(gf.get(k, []))
            for v in pv:
                if v in gv:
                    tp += 1
                    gv.remove(v)
                else:
                    fp += 1
            fn += len(gv)
    return tp, fp, fn


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s [%(process)d] %(message)s")
    torch.manual_seed(cfg.seed)

    processor = DonutProcessor.from_pretrained(cfg.pretrained)
    processor.image_processor.size = {"height": cfg.image_size[0], "width": cfg.image_size[1]}
    processor.image_processor.do_align_long_axis = False
    model = VisionEncoderDecoderModel.from_pretrained(cfg.pretrained)
    model.config.encoder.image_size = list(cfg.image_size)
    model.config.decoder.max_length = cfg.max_length

    raw = load_dataset(cfg.dataset)
    keys = set()
    train_ds = DonutParseDataset(raw["train"], processor, cfg, keys)
    val_ds = DonutParseDataset(raw["validation"], processor, cfg, keys)

    new_tokens = [TASK_START, "<sep/>"]
    for k in sorted(keys):
        new_tokens += [f"<s_{k}>", f"</s_{k}>"]
    if rank == 0:
        processor.tokenizer.add_special_tokens({"additional_special_tokens": new_tokens})
        os.makedirs(cfg.output_dir, exist_ok=True)
        processor.save_pretrained(cfg.output_dir)
        logger.info("added %d task tokens, vocab is now %d", len(new_tokens), len(processor.tokenizer))
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK_START)
    model.to(device)

    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1, num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    total = cfg.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, total)

    best_f1 = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (pixel_values, labels, _) in enumerate(train_loader):
            pixel_values = pixel_values.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=pixel_values, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 50 == 0:
                logger.info("ep %d step %d loss %.4f", epoch, step, loss.item())

        # field-level F1 on the validation split, counts summed over ranks
        model.eval()
        counts = torch.zeros(3, dtype=torch.long, device=device)
        task_ids = processor.tokenizer(TASK_START, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            for pixel_values, _, gold in val_loader:
                out = model.module.generate(
                    pixel_values.to(device),
                    decoder_input_ids=task_ids.to(device),
                    max_length=cfg.max_length,
                    pad_token_id=processor.tokenizer.pad_token_id,
                    eos_token_id=processor.tokenizer.eos_token_id,
                    bad_words_ids=[[processor.tokenizer.unk_token_id]],
                )
                pred = processor.batch_decode(out)[0]
                pred = pred.replace(processor.tokenizer.eos_token, "").replace(processor.tokenizer.pad_token, "")
                pred = pred.replace(TASK_START, "", 1)
                tp, fp, fn = field_f1([pred], [gold[0]])
                counts += torch.tensor([tp, fp, fn], device=device)
        dist.all_reduce(counts)
        tp, fp, fn = counts.tolist()
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        if rank == 0:
            logger.info("epoch %d val field F1 %.4f (tp=%d fp=%d fn=%d)", epoch, f1, tp, fp, fn)
            if f1 > best_f1:
                best_f1 = f1
                model.module.save_pretrained(os.path.join(cfg.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
