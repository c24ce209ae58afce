"""Stage-2 training of a SigLIP + Qwen2 VLM (projector + LLM, vision frozen) under FSDP.

Warm start: rank 0 reads the consolidated checkpoint into the CPU model; FSDP's
sync_module_states broadcasts it to the other ranks at wrap time.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        07_siglip_qwen_vlm.py --data /mnt/shared/llava_mix665k.json --out /mnt/shared/vlm_stage2
"""
import argparse
import functools
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, SiglipImageProcessor, SiglipVisionModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

IMAGE_TOKEN = "<image>"


class VLM(nn.Module):
    def __init__(self, vision_name, llm_name, tokenizer):
        super().__init__()
        self.vision = SiglipVisionModel.from_pretrained(vision_name)
        self.llm = AutoModelForCausalLM.from_pretrained(llm_name, torch_dtype=torch.float32)
        self.llm.resize_token_embeddings(len(tokenizer))
        vd, ld = self.vision.config.hidden_size, self.llm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(vd, ld), nn.GELU(), nn.Linear(ld, ld))
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    def forward(self, pixel_values, input_ids, attention_mask, labels):
        with torch.no_grad():
            feats = self.vision(pixel_values=pixel_values).last_hidden_state
        img = self.projector(feats)                         # B x P x D
        emb = self.llm.get_input_embeddings()(input_ids)    # B x T x D
        mask = input_ids == self.image_token_id              # one image token per sample, expanded here
        out_emb, out_lab, out_att = [], [], []
        for b in range(input_ids.shape[0]):
            pos = mask[b].nonzero()[0, 0]
            out_emb.append(torch.cat([emb[b, :pos], img[b], emb[b, pos + 1:]]))
            ign = labels.new_full((img.shape[1],), -100)
            out_lab.append(torch.cat([labels[b, :pos], ign, labels[b, pos + 1:]]))
            out_att.append(torch.cat([attention_mask[b, :pos], attention_mask.new_ones(img.shape[1]),
                                      attention_mask[b, pos + 1:]]))
        return self.llm(inputs_embeds=torch.stack(out_emb), attention_mask=torch.stack(out_att),
                        labels=torch.stack(out_lab))


class ConvDataset(Dataset):
    def __init__(self, path, image_root, tokenizer, processor, max_len=2048):
        with open(path) as f:
            self.data = json.load(f)
        self.image_root, self.tok, self.proc, self.max_len = image_root, tokenizer, processor, max_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        ex = self.data[i]
        img = Image.open(os.path.join(self.image_root, ex["image"])).convert("RGB")
        pix = self.proc(images=img, return_tensors="pt").pixel_values[0]
        ids, labels = [], []
        for turn in ex["conversations"]:
            text = turn["value"]
            if turn["from"] == "human":
                if IMAGE_TOKEN not in text and not ids:
                    text = IMAGE_TOKEN + "\n" + text
                t = self.tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").input_ids
                ids += t
                labels += [-100] * len(t)
            else:
                t = self.tok(f"{text}<|im_end|>\n").input_ids
                ids += t
                labels += t
        return pix, torch.tensor(ids[: self.max_len]), torch.tensor(labels[: self.max_len])


def collate(batch, pad_id):
    pix, ids, labels = zip(*batch)
    L = max(x.numel() for x in ids)
    input_ids = torch.full((len(ids), L), pad_id)
    lab = torch.full((len(ids), L), -100)
    att = torch.zeros((len(ids), L), dtype=torch.long)
    for i, (a, b) in enumerate(zip(ids, labels)):
        input_ids[i, : a.numel()] = a
        lab[i, : b.numel()] = b
        att[i, : a.numel()] = 1
    return torch.stack(pix), input_ids, att, lab


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vision", default="google/siglip-so400m-patch14-384")
    ap.add_argument("--llm", default="Qwen/Qwen2-7B")
    ap.add_argument("--projector-ckpt", default=None, help="stage-1 projector weights")
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-data", default=None)
    ap.add_argument("--image-root", default="/mnt/shared/images")
    ap.add_argument("--out", required=True)
    ap.add_argument("--init-from", default=None, help="consolidated VLM checkpoint to start from")
    ap.add_argument("--micro-bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=500)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    tok = AutoTokenizer.from_pretrained(args.llm)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    proc = SiglipImageProcessor.from_pretrained(args.vision)

    model = VLM(args.vision, args.llm, tok)
    model.vision.requires_grad_(False)
    if rank == 0:
        # the other ranks keep their freshly built copy; sync_module_states overwrites it
        if args.init_from:
            model.load_state_dict(torch.load(args.init_from, map_location="cpu")["model"])
        elif args.projector_ckpt:
            model.projector.load_state_dict(torch.load(args.projector_ckpt, map_location="cpu"))

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={Qwen2DecoderLayer, SiglipEncoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16),
                 device_id=torch.cuda.current_device(), sync_module_states=True, use_orig_params=True)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0)

    ds = ConvDataset(args.data, args.image_root, tok, proc)
    sampler = DistributedSampler(ds, shuffle=True, seed=7)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=8, drop_last=True,
                        collate_fn=functools.partial(collate, pad_id=tok.pad_token_id), pin_memory=True)
    total_steps = args.epochs * len(loader) // args.accum
    val_loader = None
    if args.val_data:
        val_ds = ConvDataset(args.val_data, args.image_root, tok, proc)
        val_loader = DataLoader(val_ds, batch_size=args.micro_bs, num_workers=4,
                                sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                                collate_fn=functools.partial(collate, pad_id=tok.pad_token_id))

    @torch.no_grad()
    def evaluate():
        model.eval()
        acc = torch.zeros(2, device="cuda")
        for pix, ids, att, lab in val_loader:
            pix, ids, att, lab = (t.cuda(non_blocking=True) for t in (pix, ids, att, lab))
            n = (lab[:, 1:] != -100).sum()
            acc[0] += model(pix, ids, att, lab).loss.float() * n
            acc[1] += n
        dist.all_reduce(acc)
        model.train()
        return (acc[0] / acc[1]).item()

    def save(step):
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            msd = model.state_dict()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": msd, "step": step}, os.path.join(args.out, f"step{step}.pt"))
        dist.barrier()

    step = 0
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (pix, ids, att, lab) in enumerate(loader):
            pix, ids, att, lab = (t.cuda(non_blocking=True) for t in (pix, ids, att, lab))
            last_micro = (i + 1) % args.accum == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                loss = model(pix, ids, att, lab).loss / args.accum
                loss.backward()
            if not last_micro:
                continue
            model.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total_steps} loss {l.item():.4f}", flush=True)
            if step % args.save_every == 0:
                save(step)
        if val_loader is not None:
            val_loss = evaluate()
            if rank == 0:
                print(f"epoch {epoch} val loss {val_loss:.4f}", flush=True)
    save(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
