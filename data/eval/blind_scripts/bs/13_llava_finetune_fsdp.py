"""LLaVA-1.5 stage 2 (visual instruction tuning) with FSDP.

The CLIP vision tower stays frozen and outside FSDP (it's small, replicated in
bf16 on every GPU).  LLM + projector are sharded with FULL_SHARD and wrapped
per LlamaDecoderLayer.  The projector comes from the stage-1 run.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        13_llava_finetune_fsdp.py --data llava_v1_5_mix665k_images_only.json --image-root /shared/llava_data \
        --projector /shared/ckpt/stage1/mm_projector.bin --out /shared/ckpt/llava-7b-stage2
"""
import argparse
import functools
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoConfig, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, LlamaForCausalLM,
                          get_cosine_schedule_with_warmup)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE = -100


class InstructDataset(Dataset):
    def __init__(self, path, image_root, tokenizer, image_processor, max_len=2048):
        with open(path) as f:
            self.data = [d for d in json.load(f) if "image" in d]
        self.root, self.tok, self.proc, self.max_len = image_root, tokenizer, image_processor, max_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        d = self.data[i]
        img = Image.open(os.path.join(self.root, d["image"])).convert("RGB")
        pix = self.proc(img, return_tensors="pt")["pixel_values"][0]
        ids, labels = [self.tok.bos_token_id], [IGNORE]
        sys = "A chat between a curious human and an artificial intelligence assistant. "
        for turn in d["conversations"]:
            text = turn["value"].replace("<image>", "").strip()
            if turn["from"] == "human":
                t = self.tok((sys if len(ids) == 1 else "") + "USER: " + text + " ASSISTANT:",
                             add_special_tokens=False).input_ids
                ids += t
                labels += [IGNORE] * len(t)
            else:
                t = self.tok(" " + text + self.tok.eos_token, add_special_tokens=False).input_ids
                ids += t
                labels += t
        return pix, torch.tensor(ids[:self.max_len]), torch.tensor(labels[:self.max_len])


def pad_collate(batch, pad_id):
    pix, ids, labels = zip(*batch)
    L = max(x.numel() for x in ids)
    out_ids = torch.full((len(ids), L), pad_id)
    out_lab = torch.full((len(ids), L), IGNORE)
    mask = torch.zeros((len(ids), L), dtype=torch.long)
    for i, (a, b) in enumerate(zip(ids, labels)):
        out_ids[i, :len(a)], out_lab[i, :len(b)], mask[i, :len(a)] = a, b, 1
    return torch.stack(pix), out_ids, out_lab, mask


class LlavaLM(nn.Module):
    def __init__(self, llm, vision_dim):
        super().__init__()
        self.llm = llm
        d = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision_dim, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, image_feats, input_ids, labels, attention_mask):
        img = self.mm_projector(image_feats)
        emb = self.llm.get_input_embeddings()(input_ids)
        B, N = img.shape[:2]
        inputs_embeds = torch.cat([emb[:, :1], img.to(emb.dtype), emb[:, 1:]], dim=1)
        labels = torch.cat([labels[:, :1], labels.new_full((B, N), IGNORE), labels[:, 1:]], dim=1)
        attention_mask = torch.cat([attention_mask[:, :1], attention_mask.new_ones((B, N)), attention_mask[:, 1:]], 1)
        return self.llm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels).loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--projector", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    improc = CLIPImageProcessor.from_pretrained(args.vision)
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).to(device).eval()
    vision.requires_grad_(False)

    # only rank 0 reads the weights into host memory; the other ranks build the
    # LLM on the meta device and receive the weights through sync_module_states
    if rank == 0:
        llm = LlamaForCausalLM.from_pretrained(args.llm, torch_dtype=torch.float32, low_cpu_mem_usage=True)
    else:
        with torch.device("meta"):
            llm = LlamaForCausalLM(AutoConfig.from_pretrained(args.llm))
    llm.config.use_cache = False
    model = LlavaLM(llm, vision.config.hidden_size)
    if rank == 0:
        model.mm_projector.load_state_dict(torch.load(args.projector, map_location="cpu"))

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        sync_module_states=True,
        param_init_fn=(None if rank == 0 else
                       lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False)),
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    ds = InstructDataset(args.data, args.image_root, tok, improc)
    sampler = DistributedSampler(ds, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True, collate_fn=functools.partial(pad_collate, pad_id=tok.pad_token_id))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total), total)

    def save(tag):
        # every rank has to take part in gathering the full state dict;
        # only rank 0 receives it (on CPU) and writes it
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        if rank == 0:
            path = os.path.join(args.out, tag)
            os.makedirs(path, exist_ok=True)
            torch.save({k: v for k, v in state.items() if k.startswith("mm_projector.")},
                       os.path.join(path, "mm_projector.bin"))
            llm_state = {k[len("llm."):]: v for k, v in state.items() if k.startswith("llm.")}
            torch.save(llm_state, os.path.join(path, "pytorch_model.bin"))
            llm.config.save_pretrained(path)
            tok.save_pretrained(path)
        dist.barrier()

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for pix, ids, labels, mask in loader:
            pix = pix.to(device, dtype=torch.bfloat16, non_blocking=True)
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
            with torch.no_grad():
                feats = vision(pix, output_hidden_states=True).hidden_states[-2][:, 1:]
            loss = model(feats, ids, labels, mask)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            if step % args.save_every == 0:
                save(f"checkpoint-{step}")

    save("final")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
