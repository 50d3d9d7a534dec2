"""Solar Open (solar_open): DeepSeek-V3's MoE block (shared experts after the routed ones, run on the GPU
meanwhile) under grouped-query attention."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("solar_open", experts_classes=("SolarOpenNaiveMoe", "SolarOpenExperts"),
                         shared_experts="shared_experts"))
