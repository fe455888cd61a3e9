//! The simulated engine's bundled tokenizer (`integration/sim/tokenizer.json`)
//! is the real engine's: the file `./dev setup-vllm` builds into the tiny
//! model, byte for byte. The model is rebuilt when its script or training
//! text changes; this fails then until the bundled copy is refreshed, so the
//! simulator never counts tokens otherwise than the real vLLM here.

use kvmesh_integration::paths;
use kvmesh_integration::vllm::VllmInstall;

#[test]
fn the_simulated_engine_tokenizes_with_the_real_engines_vocabulary() -> anyhow::Result<()> {
    let install = VllmInstall::find()?;
    let built = std::fs::read(install.model.join("tokenizer.json"))?;
    let bundled = std::fs::read(paths::repo_root().join("integration/sim/tokenizer.json"))?;
    assert!(
        built == bundled,
        "integration/sim/tokenizer.json differs from {}: copy the built one over it",
        install.model.join("tokenizer.json").display()
    );
    Ok(())
}
