//! ONNX Runtime's C API, opened at run time from the onnxruntime wheel's
//! libonnxruntime.so (ort-sys provides the types; nothing is linked).

use std::ffi::{c_char, c_void, CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use ort_sys::{
    GraphOptimizationLevel, ONNXTensorElementDataType, OrtAllocatorType, OrtApi, OrtApiBase, OrtEnv, OrtLoggingLevel,
    OrtMemType, OrtMemoryInfo, OrtSession, OrtStatusPtr, OrtValue, ORT_API_VERSION,
};

use crate::allocator::Registration;

/// An error ONNX Runtime reported (its OrtStatus), or one of loading it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrtError {
    /// OrtErrorCode; -1 for errors before ONNX Runtime was reached.
    pub code: i32,
    pub message: String,
}

impl fmt::Display for OrtError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ONNX Runtime error {}: {}", self.code, self.message)
    }
}

impl std::error::Error for OrtError {}

fn load_error(message: String) -> OrtError {
    OrtError { code: -1, message }
}

/// The loaded library, its API table and the process's environment.
pub struct Ort {
    _library: libloading::Library,
    api: &'static OrtApi,
    env: *mut OrtEnv,
    /// CPU memory info for input tensors the caller owns.
    input_info: *mut OrtMemoryInfo,
    version: String,
    path: PathBuf,
}

// SAFETY: OrtApi is a table of thread-safe entry points; OrtEnv and
// OrtMemoryInfo are used only through calls ONNX Runtime documents as safe
// from any thread (sessions created from one env on many threads).
unsafe impl Send for Ort {}
// SAFETY: as above.
unsafe impl Sync for Ort {}

static GLOBAL: OnceLock<Result<Ort, OrtError>> = OnceLock::new();

/// Where the wheel's library is: ORT_DYLIB_PATH, else asked of the Python
/// that has onnxruntime installed (`crate::python`).
pub fn locate_library() -> Result<PathBuf, OrtError> {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH") {
        return Ok(PathBuf::from(path));
    }
    let python = crate::python();
    let script = "import glob, os, onnxruntime\n\
                  d = os.path.join(os.path.dirname(onnxruntime.__file__), 'capi')\n\
                  print(sorted(glob.glob(os.path.join(d, 'libonnxruntime.so*')))[0])";
    let out = Command::new(&python)
        .args(["-c", script])
        .output()
        .map_err(|e| load_error(format!("running {python}: {e}")))?;
    if !out.status.success() {
        return Err(load_error(format!(
            "{python} could not import onnxruntime (pip install onnxruntime, or set ORT_DYLIB_PATH): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

impl Ort {
    /// The process's ONNX Runtime, loaded on first use. ONNX Runtime keeps
    /// one environment per process, so it is created once and kept.
    pub fn global() -> Result<&'static Ort, OrtError> {
        GLOBAL.get_or_init(|| locate_library().and_then(|path| Ort::load(&path))).as_ref().map_err(Clone::clone)
    }

    fn load(path: &Path) -> Result<Ort, OrtError> {
        // SAFETY: loading ONNX Runtime runs its initializers, which have no
        // preconditions on the caller.
        let library = unsafe { libloading::Library::new(path) }
            .map_err(|e| load_error(format!("opening {}: {e}", path.display())))?;
        // SAFETY: OrtGetApiBase has this signature in every ONNX Runtime.
        let get_base: libloading::Symbol<unsafe extern "C" fn() -> *const OrtApiBase> =
            unsafe { library.get(b"OrtGetApiBase\0") }
                .map_err(|e| load_error(format!("{}: no OrtGetApiBase: {e}", path.display())))?;
        // SAFETY: OrtGetApiBase returns a pointer to a static table.
        let base = unsafe { &*get_base() };
        // SAFETY: GetVersionString returns a static NUL-terminated string.
        let version = unsafe { CStr::from_ptr((base.GetVersionString)()) }.to_string_lossy().into_owned();
        // SAFETY: GetApi takes any version and returns NULL for one it lacks.
        let api = unsafe { (base.GetApi)(ORT_API_VERSION) };
        if api.is_null() {
            return Err(load_error(format!(
                "ONNX Runtime {version} at {} does not provide API version {ORT_API_VERSION}",
                path.display()
            )));
        }
        // SAFETY: a non-NULL OrtApi lives as long as the library, which this
        // struct keeps loaded for the process's life (it is never dropped:
        // it sits in a static).
        let api: &'static OrtApi = unsafe { &*api };
        let mut ort = Ort {
            _library: library,
            api,
            env: std::ptr::null_mut(),
            input_info: std::ptr::null_mut(),
            version,
            path: path.to_owned(),
        };
        let name = CString::new("vmm-arena").expect("no NUL");
        let mut env = std::ptr::null_mut();
        // SAFETY: name is a NUL-terminated string; env is writable.
        ort.check(unsafe { (api.CreateEnv)(OrtLoggingLevel::ORT_LOGGING_LEVEL_ERROR, name.as_ptr(), &mut env) })?;
        ort.env = env;
        let mut info = std::ptr::null_mut();
        // SAFETY: info is writable.
        ort.check(unsafe {
            (api.CreateCpuMemoryInfo)(OrtAllocatorType::OrtDeviceAllocator, OrtMemType::OrtMemTypeDefault, &mut info)
        })?;
        ort.input_info = info;
        Ok(ort)
    }

    pub fn api(&self) -> &'static OrtApi {
        self.api
    }

    pub(crate) fn env(&self) -> *mut OrtEnv {
        self.env
    }

    /// The library's own version string, e.g. "1.32.0".
    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn library_path(&self) -> &Path {
        &self.path
    }

    /// The execution providers this build of ONNX Runtime has, e.g.
    /// ["CPUExecutionProvider"] for the CPU-only wheel.
    pub fn available_providers(&self) -> Result<Vec<String>, OrtError> {
        let (mut names, mut count) = (std::ptr::null_mut(), 0);
        // SAFETY: both out-parameters are writable.
        self.check(unsafe { (self.api.GetAvailableProviders)(&mut names, &mut count) })?;
        // SAFETY: names holds count NUL-terminated strings, copied before
        // ReleaseAvailableProviders frees them.
        let providers = (0..count.max(0) as usize)
            .map(|i| unsafe { CStr::from_ptr(*names.add(i)) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: returned by GetAvailableProviders, released once.
        self.check(unsafe { (self.api.ReleaseAvailableProviders)(names, count) })?;
        Ok(providers)
    }

    /// Turns an OrtStatus into a Result, releasing the status.
    pub fn check(&self, status: OrtStatusPtr) -> Result<(), OrtError> {
        if status.0.is_null() {
            return Ok(());
        }
        // SAFETY: a non-NULL status from ONNX Runtime, read then released
        // once here.
        unsafe {
            let code = (self.api.GetErrorCode)(status.0) as i32;
            let message = CStr::from_ptr((self.api.GetErrorMessage)(status.0)).to_string_lossy().into_owned();
            (self.api.ReleaseStatus)(status.0);
            Err(OrtError { code, message })
        }
    }
}

/// How a session is made. Everything but `allocator` is the same for the
/// sessions compared, so that their outputs can be compared bit for bit.
#[derive(Clone, Copy)]
pub struct SessionConfig<'r> {
    /// intra-op threads (0: ONNX Runtime's default)
    pub threads: i32,
    /// Some: the session takes the environment's allocators
    /// (session.use_env_allocators=1), i.e. the arena registered there.
    pub allocator: Option<&'r Registration<'r>>,
    /// ONNX Runtime's own CPU arena (BFC) when no allocator is given; false:
    /// plain malloc/free.
    pub cpu_mem_arena: bool,
    /// Some(ordinal): the CUDA execution provider on that device comes
    /// first (it needs the onnxruntime-gpu wheel; CPU-only builds fail
    /// session creation with ONNX Runtime's error). Inputs and outputs stay
    /// in CPU memory; ONNX Runtime copies them.
    pub cuda_device: Option<i32>,
}

impl Default for SessionConfig<'_> {
    fn default() -> Self {
        SessionConfig { threads: 1, allocator: None, cpu_mem_arena: true, cuda_device: None }
    }
}

/// A session of the decoder model: input "x" and output "y", both
/// [1, seq, d_model] float32.
pub struct Session<'r> {
    ort: &'static Ort,
    raw: *mut OrtSession,
    /// The registered allocator, if any, must outlive the session (ONNX
    /// Runtime holds its pointer).
    _allocator: PhantomData<&'r Registration<'r>>,
}

struct SessionOptions<'a>(&'a Ort, *mut ort_sys::OrtSessionOptions);

impl Drop for SessionOptions<'_> {
    fn drop(&mut self) {
        // SAFETY: created by CreateSessionOptions and released once.
        unsafe { (self.0.api.ReleaseSessionOptions)(self.1) };
    }
}

/// Appends the CUDA execution provider on device `ordinal` to `options`.
fn append_cuda(ort: &Ort, options: *mut ort_sys::OrtSessionOptions, ordinal: i32) -> Result<(), OrtError> {
    let api = ort.api;
    let mut cuda = std::ptr::null_mut();
    // SAFETY: cuda is writable. CPU-only builds return an error status.
    ort.check(unsafe { (api.CreateCUDAProviderOptions)(&mut cuda) })?;
    let device_id = CString::new(ordinal.to_string()).expect("digits");
    let keys = [c"device_id".as_ptr()];
    let values = [device_id.as_ptr()];
    // SAFETY: cuda is live until released below; keys and values hold one
    // NUL-terminated string each; options is live.
    let result = unsafe {
        ort.check((api.UpdateCUDAProviderOptions)(cuda, keys.as_ptr(), values.as_ptr(), 1))
            .and_then(|()| ort.check((api.SessionOptionsAppendExecutionProvider_CUDA_V2)(options, cuda)))
    };
    // SAFETY: created above and released once; the session options copy it.
    unsafe { (api.ReleaseCUDAProviderOptions)(cuda) };
    result
}

impl<'r> Session<'r> {
    pub fn new(ort: &'static Ort, model: &Path, config: SessionConfig<'r>) -> Result<Session<'r>, OrtError> {
        let api = ort.api;
        let mut raw_options = std::ptr::null_mut();
        // SAFETY: raw_options is writable.
        ort.check(unsafe { (api.CreateSessionOptions)(&mut raw_options) })?;
        let options = SessionOptions(ort, raw_options);
        // SAFETY: options.1 is a live OrtSessionOptions for each call below.
        unsafe {
            ort.check((api.SetIntraOpNumThreads)(options.1, config.threads))?;
            ort.check((api.SetInterOpNumThreads)(options.1, 1))?;
            ort.check((api.SetSessionGraphOptimizationLevel)(options.1, GraphOptimizationLevel::ORT_ENABLE_ALL))?;
            if config.allocator.is_some() {
                let key = CString::new("session.use_env_allocators").expect("no NUL");
                let one = CString::new("1").expect("no NUL");
                ort.check((api.AddSessionConfigEntry)(options.1, key.as_ptr(), one.as_ptr()))?;
            } else if !config.cpu_mem_arena {
                ort.check((api.DisableCpuMemArena)(options.1))?;
            }
        }
        if let Some(ordinal) = config.cuda_device {
            append_cuda(ort, options.1, ordinal)?;
        }
        let path = CString::new(model.as_os_str().as_encoded_bytes())
            .map_err(|_| load_error(format!("model path {} has a NUL", model.display())))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: env and options are live; path is NUL-terminated; raw is writable.
        ort.check(unsafe { (api.CreateSession)(ort.env, path.as_ptr(), options.1, &mut raw) })?;
        Ok(Session { ort, raw, _allocator: PhantomData })
    }

    /// Runs the model on `x` ([1, seq, d_model], row-major) and returns
    /// "y". The output tensor is allocated by ONNX Runtime with the
    /// session's allocator, copied out, and released before returning.
    pub fn run(&self, x: &[f32], seq: usize, d_model: usize) -> Result<Vec<f32>, OrtError> {
        assert_eq!(x.len(), seq * d_model, "x must be [1, seq, d_model]");
        let api = self.ort.api;
        let shape = [1i64, seq as i64, d_model as i64];
        let mut input = std::ptr::null_mut();
        // SAFETY: x outlives the input value (released below, before
        // returning); ONNX Runtime only reads an input's buffer.
        self.ort.check(unsafe {
            (api.CreateTensorWithDataAsOrtValue)(
                self.ort.input_info,
                x.as_ptr() as *mut c_void,
                std::mem::size_of_val(x),
                shape.as_ptr(),
                shape.len(),
                ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                &mut input,
            )
        })?;
        let input_name = c"x";
        let output_name = c"y";
        let input_names: [*const c_char; 1] = [input_name.as_ptr()];
        let output_names: [*const c_char; 1] = [output_name.as_ptr()];
        let inputs: [*const OrtValue; 1] = [input];
        let mut output: *mut OrtValue = std::ptr::null_mut();
        // SAFETY: the session, names and values are live; output is
        // writable and NULL, so ONNX Runtime allocates it.
        let status = unsafe {
            (api.Run)(
                self.raw,
                std::ptr::null(),
                input_names.as_ptr(),
                inputs.as_ptr(),
                1,
                output_names.as_ptr(),
                1,
                &mut output,
            )
        };
        // SAFETY: input was created above and is not used again.
        unsafe { (api.ReleaseValue)(input) };
        self.ort.check(status)?;
        let result = self.read_output(output, seq * d_model);
        // SAFETY: output was allocated by Run and is not used again.
        unsafe { (api.ReleaseValue)(output) };
        result
    }

    fn read_output(&self, output: *mut OrtValue, expected: usize) -> Result<Vec<f32>, OrtError> {
        let api = self.ort.api;
        let mut info = std::ptr::null_mut();
        // SAFETY: output is a live tensor value; info is writable.
        self.ort.check(unsafe { (api.GetTensorTypeAndShape)(output, &mut info) })?;
        let mut count = 0usize;
        // SAFETY: info is live until released right after.
        let status = unsafe { (api.GetTensorShapeElementCount)(info, &mut count) };
        // SAFETY: released once.
        unsafe { (api.ReleaseTensorTypeAndShapeInfo)(info) };
        self.ort.check(status)?;
        if count != expected {
            return Err(load_error(format!("output has {count} elements, expected {expected}")));
        }
        let mut data = std::ptr::null_mut();
        // SAFETY: output is a live tensor; data is writable.
        self.ort.check(unsafe { (api.GetTensorMutableData)(output, &mut data) })?;
        // SAFETY: a float tensor of `count` elements lives at data while
        // output is alive.
        Ok(unsafe { std::slice::from_raw_parts(data as *const f32, count) }.to_vec())
    }

    pub(crate) fn raw(&self) -> *mut OrtSession {
        self.raw
    }

    pub fn ort(&self) -> &'static Ort {
        self.ort
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // SAFETY: created by CreateSession and released once.
        unsafe { (self.ort.api.ReleaseSession)(self.raw) };
    }
}
