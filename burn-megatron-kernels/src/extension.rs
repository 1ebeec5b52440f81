//! `extension!`: a backend extension's trait, its CPU implementation and its CUDA
//! implementation from one list of its methods' signatures.
//!
//! Every op of this crate is a Burn backend extension (`#[backend_extension]`) implemented three
//! times: for the CPU backend by its reference twin, for CubeCL's CUDA backend by its kernels,
//! and for Autodiff by its own backward. The first two only forward each method, so the macro
//! writes them from one list of signatures: each method's body is the CPU backend's (the
//! reference twin, `Self` being the CPU backend), and the CUDA implementation calls the function
//! of the same name in the op's kernel module with the same arguments. The Autodiff
//! implementation is the op's own, beside it.
//!
//! ```ignore
//! extension! {
//!     /// The backend extension behind [`swiglu`].
//!     pub trait SwigluOps, cuda: kernel;
//!
//!     /// `silu(a) ∘ b`.
//!     fn swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>, notes: NoteAmaxes) -> FloatTensor<Self> {
//!         reference::forward::<Self>(a, b)
//!     }
//! }
//! ```
//!
//! Signatures pass through as plain tokens (`#[backend_extension]` reads their types by name,
//! which a macro's typed fragment would hide), so the macro walks them token by token: an
//! argument's type may hold no top-level comma (a tuple type is one token group, and so is fine).

macro_rules! extension {
    // The trait's attributes, name and the module of its CUDA functions; then its methods.
    ($(# $attr:tt)* pub trait $name:ident, cuda: $kernel:ident; $($methods:tt)*) => {
        extension!(@next [$name $kernel [$(# $attr)*]] [] [] [] $($methods)*);
    };
    // No method left: the trait, the CPU's implementation, CUDA's.
    (@next [$name:ident $kernel:ident [$($attr:tt)*]] [$($trait:tt)*] [$($flex:tt)*] [$($cube:tt)*]) => {
        $($attr)*
        #[burn::backend::backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
        pub trait $name: burn::backend::Backend {
            $($trait)*
        }

        /// The CPU backend: the reference twin.
        impl $name for burn::backend::Flex {
            $($flex)*
        }

        /// CubeCL's CUDA backend: the op's kernels.
        #[cfg(feature = "cuda")]
        impl $name for burn::backend::Cube {
            $($cube)*
        }
    };
    // The next method: its attributes, name and arguments; its return type follows.
    (@next $head:tt $trait:tt $flex:tt $cube:tt $(# $m:tt)* fn $method:ident $args:tt -> $($rest:tt)*) => {
        extension!(@ret $head $trait $flex $cube [$(# $m)*] $method $args [] $($rest)*);
    };
    // Its return type, a token at a time up to its body.
    (@ret $head:tt $trait:tt $flex:tt $cube:tt $attrs:tt $method:ident $args:tt [$($ret:tt)*] { $($body:tt)* } $($rest:tt)*) => {
        extension!(@args $head $trait $flex $cube $attrs $method $args [$($ret)*] [$($body)*] [$($rest)*] $args);
    };
    (@ret $head:tt $trait:tt $flex:tt $cube:tt $attrs:tt $method:ident $args:tt [$($ret:tt)*] $t:tt $($rest:tt)*) => {
        extension!(@ret $head $trait $flex $cube $attrs $method $args [$($ret)* $t] $($rest)*);
    };
    // Its arguments' names, for the call CUDA's implementation makes.
    (@args $head:tt $trait:tt $flex:tt $cube:tt $attrs:tt $method:ident $args:tt $ret:tt $body:tt $rest:tt ($($a:tt)*)) => {
        extension!(@name $head $trait $flex $cube $attrs $method $args $ret $body $rest [] $($a)*);
    };
    (@name $head:tt $trait:tt $flex:tt $cube:tt $attrs:tt $method:ident $args:tt $ret:tt $body:tt $rest:tt [$($n:ident)*] $arg:ident : $($more:tt)*) => {
        extension!(@type $head $trait $flex $cube $attrs $method $args $ret $body $rest [$($n)* $arg] $($more)*);
    };
    (@type $head:tt $trait:tt $flex:tt $cube:tt $attrs:tt $method:ident $args:tt $ret:tt $body:tt $rest:tt [$($n:ident)*] , $($more:tt)*) => {
        extension!(@name $head $trait $flex $cube $attrs $method $args $ret $body $rest [$($n)*] $($more)*);
    };
    (@type $head:tt $trait:tt $flex:tt $cube:tt $attrs:tt $method:ident $args:tt $ret:tt $body:tt $rest:tt [$($n:ident)*] $t:tt $($more:tt)*) => {
        extension!(@type $head $trait $flex $cube $attrs $method $args $ret $body $rest [$($n)*] $($more)*);
    };
    (@type $head:tt $trait:tt $flex:tt $cube:tt $attrs:tt $method:ident $args:tt $ret:tt $body:tt $rest:tt [$($n:ident)*]) => {
        extension!(@name $head $trait $flex $cube $attrs $method $args $ret $body $rest [$($n)*]);
    };
    // Every name: the method joins the trait, the CPU's implementation (its body) and CUDA's.
    (@name [$name:ident $kernel:ident $tattrs:tt] [$($trait:tt)*] [$($flex:tt)*] [$($cube:tt)*] [$($attr:tt)*] $method:ident $args:tt [$($ret:tt)*] [$($body:tt)*] [$($rest:tt)*] [$($n:ident)*]) => {
        extension!(@next [$name $kernel $tattrs]
            [
                $($trait)*
                $($attr)*
                #[allow(clippy::too_many_arguments)]
                fn $method $args -> $($ret)*;
            ]
            [
                $($flex)*
                #[allow(unused_variables, clippy::too_many_arguments)]
                fn $method $args -> $($ret)* { $($body)* }
            ]
            [
                $($cube)*
                #[allow(clippy::too_many_arguments)]
                fn $method $args -> $($ret)* { $kernel::$method($($n),*) }
            ]
            $($rest)*);
    };
}
